"""The library experts' sync-free pieces on the CPU: the device-side grouping against a Python
model, the plain-torch fallbacks (forced) against the trusted reference, fp8 dequantization
through the kernel, and (when triton is installed) the Triton kernels in its interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from dbo.backends.local import LocalPrepareAndFinalize
from dbo.experts import SwiGLUExperts, make_expert_weights, reference_moe, relative_error
from dbo.experts.grouping import group_by_expert
from dbo.experts.kernels.gather_reduce import gather_reduce
from dbo.moe import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEKernel,
    PrepareResult,
    Workspace,
    topk_route,
)

pytestmark = pytest.mark.timeout(120)


def make_case(seed: int, m: int, n_local: int, topk: int, ranks: int = 2, hidden: int = 24, inter: int = 16):
    """Tokens routed over ``ranks * n_local`` experts; local ids, -1 for the other ranks'."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    weights, ids = topk_route(torch.randn(m, ranks * n_local, generator=g), topk)
    local_ids = torch.where(ids < n_local, ids, -1)
    w1, w2 = make_expert_weights(n_local, hidden, inter, seed=seed)
    return x, weights, local_ids, w1, w2


def _host_counts(ids: torch.Tensor, n_local: int) -> torch.Tensor:
    return torch.bincount(ids[ids >= 0].flatten(), minlength=n_local).to(torch.int32)


def run_case(experts, x, w1, w2, weights, ids, host: bool, *, router_on_input=False, **kw):
    meta = None
    if host:
        c = _host_counts(ids, w1.shape[0])
        meta = ExpertTokensMetadata(c, c)
    out = experts.apply(x, w1, w2, weights, ids, activation_format=ActivationFormat.STANDARD,
                        expert_tokens_meta=meta, apply_router_weight_on_input=router_on_input,
                        workspace=Workspace(), **kw)
    if out.dim() == 3:  # reduce_in_experts=False: weight and sum here
        out = (out.float() * weights[..., None]).sum(1).to(x.dtype)
    return out


@given(seed=st.integers(0, 2**16), m=st.integers(0, 20), n_local=st.integers(1, 6),
       topk=st.integers(1, 8), host=st.booleans())
def test_grouping_matches_a_python_model(seed, m, n_local, topk, host):
    topk = min(topk, 2 * n_local)
    _, _, ids, _, _ = make_case(seed, m, n_local, topk)
    g = group_by_expert(ids, n_local, _host_counts(ids, n_local) if host else None)
    pairs = sorted((int(e), t * topk + s) for t, row in enumerate(ids.tolist())
                   for s, e in enumerate(row) if e >= 0)
    note(f"pairs {pairs}")
    counts = [sum(1 for e, _ in pairs if e == x) for x in range(n_local)]
    assert g.offsets.tolist() == [sum(counts[:i + 1]) for i in range(n_local)]
    assert g.num_rows == (len(pairs) if host else m * topk)
    assert g.tokens.shape == (g.num_rows,)
    for row, (_, slot) in enumerate(pairs):  # stable: by expert, then by slot
        assert g.slot_rows.view(-1)[slot] == row and g.tokens[row] == slot // topk
    assert g.local.tolist() == (ids >= 0).tolist()
    assert (g.slot_rows[~g.local] == 0).all()
    assert all(0 <= t < max(m, 1) for t in g.tokens.tolist())


def test_grouping_argument_errors():
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="host_counts"):
        group_by_expert(ids, 4, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_local_experts"):
        group_by_expert(ids, 0)
    with pytest.raises(ValueError, match="topk_ids"):
        group_by_expert(ids.view(-1), 4)


@given(seed=st.integers(0, 2**16), m=st.integers(0, 24), n_local=st.sampled_from([1, 3, 8]),
       topk=st.integers(1, 8), host=st.booleans(), reduce_in_experts=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scratch_tokens=st.sampled_from([None, 1, 5]))
@settings(deadline=None)
def test_torch_fallback_matches_reference(seed, m, n_local, topk, host, reduce_in_experts, dtype,
                                          scratch_tokens):
    topk = min(topk, 2 * n_local)
    x, weights, ids, w1, w2 = make_case(seed, m, n_local, topk)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    ref = reference_moe(x.double(), w1.double(), w2.double(), weights, ids, out_dtype=torch.float64)
    # scratch_tokens: a scratch bound that holds that many tokens' slot rows, so larger calls
    # run in chunks of tokens
    scratch = None if scratch_tokens is None else scratch_tokens * topk * x.shape[1] * x.element_size()
    ex = SwiGLUExperts(use_triton=False, reduce_in_experts=reduce_in_experts, max_scratch_bytes=scratch)
    if scratch_tokens is not None:
        assert ex.chunk_tokens(topk, x.shape[1], x.element_size()) == scratch_tokens
    out = run_case(ex, x, w1, w2, weights, ids, host)
    assert out.shape == x.shape and out.dtype == dtype
    assert relative_error(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4G"])
def test_max_scratch_bytes_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        SwiGLUExperts(max_scratch_bytes=bad)


def test_router_weight_on_input_and_no_local_pairs():
    x, weights, ids, w1, w2 = make_case(1, 12, 4, 1)
    xw = x * weights  # what prepare hands over with apply_router_weight_on_input
    ref = reference_moe(x, w1, w2, weights, ids, apply_router_weight_on_input=True)
    for host in (False, True):
        out = run_case(SwiGLUExperts(use_triton=False), xw, w1, w2, weights, ids, host,
                     router_on_input=True)
        assert relative_error(out, ref) < 1e-5
        none = run_case(SwiGLUExperts(use_triton=False), x, w1, w2, weights, torch.full_like(ids, -1), host)
        assert none.shape == x.shape and not none.any()


def test_gather_reduce_never_reads_rows_of_other_ranks_slots():
    y = torch.randn(6, 8)
    y[3:] = float("nan")  # rows past the local pairs: uninitialised in the real kernels
    rows = torch.tensor([[0, 3], [2, 5], [1, 0]])
    local = torch.tensor([[True, False], [True, False], [True, True]])
    w = torch.rand(3, 2)
    out = gather_reduce(y, rows, w, local, use_triton=False)
    want = torch.stack([w[0, 0] * y[0], w[1, 0] * y[2], w[2, 0] * y[1] + w[2, 1] * y[0]])
    assert torch.allclose(out, want)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.view(x.shape[0], -1, 128)
    scale = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


class _Fp8Local(LocalPrepareAndFinalize):
    """The local backend, handing fp8 activations and their block scales to the experts."""

    def prepare_async(self, *args, **kwargs):
        hook, receiver = super().prepare_async(*args, **kwargs)

        def quantized() -> PrepareResult:
            res = receiver()
            q, scale = _quantize(res.a1q)
            return res._replace(a1q=q, a1q_scale=scale)

        return hook, quantized


def test_fp8_inputs_are_dequantized_with_their_scales():
    x, weights, ids, w1, w2 = make_case(2, 10, 4, 2, ranks=1, hidden=256)
    q, scale = _quantize(x)
    deq = (q.float().view(10, 2, 128) * scale[..., None]).view(10, 256)
    ref = reference_moe(deq, w1, w2, weights, ids)
    kernel = MoEKernel(_Fp8Local(ActivationFormat.STANDARD, use_async=False), SwiGLUExperts(use_triton=False))
    out = kernel(x, w1, w2, weights, ids, global_num_experts=4)
    assert relative_error(out, ref) < 1e-5
    with pytest.raises(TypeError, match="a1q_scale"):
        run_case(SwiGLUExperts(use_triton=False), q, w1, w2, weights, ids, False)
    with pytest.raises(ValueError, match="a1q_scale"):
        run_case(SwiGLUExperts(use_triton=False), q, w1, w2, weights, ids, False, a1q_scale=scale[:, :1])


_TRITON_SCRIPT = """
import torch
from dbo.testing.triton_interpreter import fast_xor_reduce
fast_xor_reduce()  # tl.sort's xor reductions in one numpy call each, not element by element
from tests.test_moe_experts import run_case, make_case
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
for seed, m, n_local, topk, host, red in [(0, 37, 5, 3, False, True), (1, 37, 5, 3, True, False),
                                          (2, 1, 3, 1, False, True), (3, 64, 16, 8, False, True),
                                          (4, 0, 2, 2, False, True), (5, 9, 2, 4, True, True),
                                          (6, 200, 2, 2, False, True), (7, 150, 3, 2, True, True)]:
    x, weights, ids, w1, w2 = make_case(seed, m, n_local, topk, hidden=40, inter=24)
    ref = reference_moe(x, w1, w2, weights, ids)
    # the last case in chunks of 50 tokens (a scratch bound of 50 tokens' slot rows)
    scratch = 50 * topk * 40 * 4 if seed == 7 else None
    out = run_case(SwiGLUExperts(use_triton=True, reduce_in_experts=red, max_scratch_bytes=scratch),
                   x, w1, w2, weights, ids, host)
    err = relative_error(out, ref)
    assert err < 1e-5, (seed, err)
from dbo.experts.kernels.fused_experts import route_order
for seed, (m, topk, n_local) in enumerate([(37, 3, 5), (700, 8, 16), (300, 8, 256), (2048, 8, 32)]):
    ids = torch.randint(-1, n_local + 2, (m, topk), generator=torch.Generator().manual_seed(seed))
    order, offsets = route_order(ids.to(torch.int32), n_local)  # the counting sort, several chunks
    flat = ids.reshape(-1)
    local = (flat >= 0) & (flat < n_local)
    rows = order[:int(local.sum())].long()
    assert sorted(rows.tolist()) == torch.nonzero(local).flatten().tolist(), seed
    assert (flat[rows][1:] >= flat[rows][:-1]).all(), seed
    assert torch.equal(offsets.long(), torch.cumsum(torch.bincount(flat[local], minlength=n_local), 0))
from dbo.experts.kernels.fused_experts import tile_map
from dbo.experts.kernels.fused_maps import MAP_ENTRY
def _groups(n, g):
    # an expert's n row tiles in ceil(n / g) groups of as equal sizes as can be: (start, size)
    k = max(1, -(-n // g))
    starts = [-(-c * n // k) for c in range(k + 1)]
    return [(starts[c], starts[c + 1] - starts[c]) for c in range(k) for _ in range(starts[c], starts[c + 1])]
assert _groups(9, 8) == [(0, 5)] * 5 + [(5, 4)] * 4 and _groups(3, 8) == [(0, 3)] * 3
for counts, block_m, pairs, group in [([5, 0, 33, 32, 0, 1], 16, 71, 8), ([0, 0, 0], 32, 4, 8),
                                      ([200] + [0] * 40, 16, 200, 8), ([3] * 70, 16, 400, 8),
                                      ([5, 0, 33, 32, 0, 1], 4, 71, 3), ([150, 7, 40, 0, 97], 8, 300, 5),
                                      ([150, 7, 40, 0, 97], 8, 300, 1)]:
    # the flat down kernel's row tiles: every expert's rows in tiles of block_m, in order (an
    # expert without rows has none; a bound of pairs above the rows leaves the rest unwritten),
    # each with its group: at most `group` row tiles, all of one expert
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    firsts = [0, *offsets.tolist()[:-1]]
    want, tile0 = [], 0
    for e, (first, c) in enumerate(zip(firsts, counts)):
        r0s = range(first, first + c, block_m)
        want += [(e, r0, first + c, tile0 + g0, gn) for r0, (g0, gn) in zip(r0s, _groups(len(r0s), group))]
        tile0 += len(r0s)
    got, none = tile_map(offsets, block_m, pairs, group_m=group)
    n = int(got[0])
    assert n == len(want) and none is None, (counts, n)
    assert [tuple(r) for r in got[1:1 + MAP_ENTRY * n].view(-1, MAP_ENTRY).tolist()] == want, (counts, group)
for seed, (m, topk, n_local) in enumerate([(37, 3, 5), (700, 8, 16), (300, 6, 256)]):
    # with the sole rows marked: ~slot where the slot's token has no other local slot
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 4 * n_local, (m, topk), generator=g).to(torch.int32)
    order, offsets = route_order(ids, n_local)
    _, dest = tile_map(offsets, 16, m * topk, (order, ids))
    n = int(offsets[-1])
    per_token = ((ids >= 0) & (ids < n_local)).sum(1)
    want = [~o if per_token[o // topk] == 1 else o for o in order[:n].tolist()]
    assert dest[:n].tolist() == want and any(w < 0 for w in want), seed
from dbo.experts.kernels.fused_experts import tile_maps
for seed, (m, topk, n_local, heights, n_zero, groups) in enumerate([
        (300, 8, 16, (16, 32), 300, (8, 8)), (700, 8, 5, (64, 16), 7, (3, 2)), (37, 3, 5, (32,), 0, (8,)),
        (700, 8, 5, (16, 16), 0, (8, 3))]):
    # one launch for two maps (heights, groups), the sole rows' marks and zeroed counters: the
    # same as one launch per map
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 2 * n_local, (m, topk), generator=g).to(torch.int32)
    order, offsets = route_order(ids, n_local)
    zero = torch.full((n_zero,), 7, dtype=torch.int32)
    maps, dest = tile_maps(offsets, heights, m * topk, (order, ids), zero, groups)
    n = int(offsets[-1])
    assert len(maps) == len(heights) and not zero.any(), seed
    for got, bm, gm in zip(maps, heights, groups):
        want, want_dest = tile_map(offsets, bm, m * topk, (order, ids), gm)
        k = 1 + MAP_ENTRY * int(want[0])
        assert torch.equal(got[:k], want[:k]) and torch.equal(dest[:n], want_dest[:n]), (seed, bm)
from dbo.experts.kernels.fused_experts import route_with_maps
for seed, (m, topk, n_local, heights, sole, groups) in enumerate([
        (300, 8, 16, (64, 128), True, (8, 8)), (200, 8, 32, (16,), True, (2,)),
        (90, 6, 5, (32, 16), False, (3, 5)), (5, 2, 3, (16,), True, (8,)),
        (90, 6, 5, (16, 16), True, (8, 2))]):
    # the counting sort's second launch also builds the maps, the marks and zeros: the same
    # values as route_order and then tile_maps (several chunks in the first two cases)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 2 * n_local, (m, topk), generator=g).to(torch.int32)
    zero = torch.full((40,), 3, dtype=torch.int32)
    order, offsets, maps, dest = route_with_maps(ids, n_local, heights, m * topk, sole, zero, groups=groups)
    want_order, want_offsets = route_order(ids, n_local)
    want_maps, want_dest = tile_maps(want_offsets, heights, m * topk, (want_order, ids) if sole else None,
                                     groups=groups)
    n = int(want_offsets[-1])
    assert torch.equal(offsets, want_offsets) and torch.equal(order[:n], want_order[:n]), seed
    assert not zero.any() and (dest is None) == (not sole), seed
    assert sole is False or torch.equal(dest[:n], want_dest[:n]), seed
    for got, want in zip(maps, want_maps):
        k = 1 + MAP_ENTRY * int(want[0])
        assert torch.equal(got[:k], want[:k]), (seed, got[:k], want[:k])
from dbo.experts.kernels.fused_experts import GemmConfig, fused_swiglu_experts
for seed, m, n_local, topk, tail, red, down_kind, persistent in [
        (0, 37, 5, 3, 16, True, "k", True), (1, 150, 3, 2, 16, False, "k", False),
        (2, 1, 3, 1, 0, True, "k", True), (3, 90, 4, 3, 16, True, "k", False),
        (4, 70, 3, 2, 0, True, "short", True), (5, 41, 5, 2, 0, True, "short", False),
        (6, 90, 4, 3, 0, True, "flat", True), (7, 150, 3, 2, 0, False, "flat", True),
        (8, 40, 3, 2, 0, True, "flat-misaligned", True)]:
    # fp16 (the interpreter's bf16 dot is wrong): the TMA tiles, full and tail; the short-K
    # down kernel (short); the flat persistent down kernel (flat); a program per tile or a few
    # walking the tiles (persistent); weights that TMA cannot take (a misaligned view) fall back
    # to pointer loads
    x, weights, ids, w1, w2 = make_case(seed, m, n_local, topk, hidden=64, inter=32)
    x, w1, w2 = x.half(), w1.half(), w2.half()
    if down_kind == "flat-misaligned":
        w1 = torch.empty(w1.numel() + 1, dtype=w1.dtype)[1:].view_as(w1).copy_(w1)
        w2 = torch.empty(w2.numel() + 1, dtype=w2.dtype)[1:].view_as(w2).copy_(w2)
        down_kind = "flat"
    ref = reference_moe(x.float(), w1.float(), w2.float(), weights, ids)
    cfg = GemmConfig(32, 16, 16, 2, 4, 2, tma=True, tail_m=tail)
    down = {"short": GemmConfig(32, 16, 32, 2, 4, 2, n_per_program=2),
            "flat": GemmConfig(32, 16, 16, 2, 4, 2, flat=True),
            "k": GemmConfig(32, 16, 16, 2, 4, 2, tma=True, tail_m=tail)}[down_kind]
    out = torch.empty((m, 64) if red else (m, topk, 64), dtype=torch.float16)
    fused_swiglu_experts(x, w1, w2, weights, ids, out=out, reduce=red, configs=(cfg, down),
                         persistent=persistent, sole_pairs=False)
    got = out.float() if red else (out.float() * weights.unsqueeze(-1)).sum(1)
    err = relative_error(got, ref)
    assert err < 2e-3, (seed, err)
    if red and down.flat:  # the sole slots' rows written by the down kernel: the same bits
        sole = torch.full_like(out, float("nan"))
        fused_swiglu_experts(x, w1, w2, weights, ids, out=sole, reduce=red, configs=(cfg, down),
                             persistent=persistent, sole_pairs=True)
        per_token = ((ids >= 0) & (ids < n_local)).sum(1)
        assert bool((per_token == 1).any()) and bool((per_token > 1).any()), seed
        assert bool((per_token == 0).any()), seed  # (their zero rows: the down kernel's too)
        assert torch.equal(sole, out), (seed, (sole - out).abs().max())
# a warp-specialized gate/up tile (Gluon, Hopper only) runs here as the Triton kernel with its blocks
x, weights, ids, w1, w2 = make_case(9, 90, 4, 3, hidden=64, inter=32)
x, w1, w2 = x.half(), w1.half(), w2.half()
down = GemmConfig(32, 16, 16, 2, 4, 2, flat=True)
outs = []
for up in (GemmConfig(64, 16, 16, 2, 8, 2, ws=True), GemmConfig(64, 16, 16, 2, 4, 2, tma=True)):
    outs.append(torch.empty(90, 64, dtype=torch.float16))
    fused_swiglu_experts(x, w1, w2, weights, ids, out=outs[-1], configs=(up, down), persistent=True)
assert torch.equal(outs[0], outs[1])
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
# the interpreter runs every kernel in numpy: about 20 s on a 2-core VM (Triton 3.8), 75-270 s
# where fast_xor_reduce cannot install its xor reduction (tl.sort's) and Python runs it
@pytest.mark.timeout(630)
def test_triton_kernels_in_the_interpreter():
    # the grouped GEMM, the activation and the gather-reduce, run by Triton's CPU interpreter
    # (the last two cases reach every tail tile size of the fused kernels' float32 tile)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("block", [8, 1000, 3072])
def test_topk_sum_block_must_be_a_power_of_two(block):
    from dbo.experts.kernels.fused_experts import launch_topk_sum

    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        launch_topk_sum(torch.zeros(8, 64), ids, torch.ones(4, 2), torch.zeros(4, 64), 1, block=block)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_direct_launch_keys_follow_tritons_specialization(monkeypatch):
    # dbo.kernels.triton_launch keeps a compiled kernel per specialization: the key tells apart
    # what Triton compiles apart (an int of 1, a multiple of 16, a 64-bit int, a pointer's
    # 16-byte alignment), and refuses arguments it does not know; under the interpreter, or
    # with DBO_TRITON_FAST_LAUNCH=0, every launch goes through kernel[grid]
    from dbo.kernels import triton_launch as tlaunch

    spec = tlaunch._spec
    assert len({spec(1), spec(16), spec(17), spec(2 ** 31 + 16)}) == 4
    assert spec(32) == spec(48) and spec(3) == spec(5)
    t = torch.zeros(16)
    assert spec(t) != spec(t[1:]) and spec(t) == spec(t[4:]) and spec(t) != spec(t.double())
    with pytest.raises(TypeError):
        spec(object())
    monkeypatch.setenv("DBO_TRITON_FAST_LAUNCH", "0")
    tlaunch.clear_launch_cache()
    assert not tlaunch.fast_launch_enabled()
    monkeypatch.setenv("DBO_TRITON_FAST_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tlaunch.clear_launch_cache()
    assert not tlaunch.fast_launch_enabled()
    tlaunch.clear_launch_cache()


def test_maps_reject_bad_requests_before_launching():
    # (raised on the host before any launch: no Triton needed)
    from dbo.experts.kernels.fused_maps import tile_maps
    from dbo.experts.kernels.fused_route import route_order_with_maps, route_with_maps

    ids = torch.zeros(8, 2, dtype=torch.int32)
    offsets = torch.tensor([10, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="one or two tile heights"):
        tile_maps(offsets, (16, 32, 64), 16)
    with pytest.raises(ValueError, match="one or two maps"):
        route_order_with_maps(ids, 2, (torch.zeros(7, dtype=torch.int32),), (16, 32), 64)
    with pytest.raises(ValueError, match=r"\[M, topk\] ids"):
        route_order_with_maps(ids.flatten(), 2, (torch.zeros(7, dtype=torch.int32),), (16,), 64,
                              dest=torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        route_with_maps(ids, 2, (16,), 16, True, zero=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="a group size"):
        tile_maps(offsets, (16,), 16, groups=(0,))
    with pytest.raises(ValueError, match="a group size"):
        route_order_with_maps(ids, 2, (torch.zeros(7, dtype=torch.int32),), (16,), 64, groups=(8, 8))


def test_tma_tiles_fall_back_below_sm90(monkeypatch):
    # the TMA tiles (and the flat down kernel, which loads through TMA only) need sm_90: on an
    # older GPU the pointer-load tiles run instead
    from types import SimpleNamespace

    from dbo.experts.kernels import fused_experts

    gpu_tensor = SimpleNamespace(is_cuda=True, device="cuda:0")
    for major, want in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(fused_experts, "_props", lambda d, m=major: SimpleNamespace(major=m))
        assert fused_experts._tma_ok(gpu_tensor) is want
    assert fused_experts._tma_ok(torch.zeros(1))  # a CPU tensor: Triton's interpreter emulates TMA
    cfg = fused_experts.GemmConfig(32, 16, 16, 2, 4, 2, flat=True)
    act, w2 = torch.zeros(4, 16), torch.zeros(2, 8, 16)
    monkeypatch.setattr(fused_experts, "_aligned", lambda *t: True)
    for ok in (False, True):
        monkeypatch.setattr(fused_experts, "_tma_ok", lambda t, ok=ok: ok)
        assert fused_experts.runs_flat(cfg, act, w2) is ok
