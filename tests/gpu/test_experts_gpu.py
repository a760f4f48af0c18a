"""The library's experts on a GPU: ``SwiGLUExperts.apply`` never waits for the GPU from the host
(it runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing
call) and matches the float64 reference, in STANDARD format with and without the backend's host
counts, bf16 and float32, top-1..8, slots routed to other ranks (-1), zero tokens; the Triton
kernels against plain torch. Run on the GPU host: ``pytest tests/gpu/test_experts_gpu.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dbo.bench.syncs import no_host_syncs
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
from dbo.experts.kernels.gather_reduce import gather_reduce, gather_rows, silu_and_mul
from dbo.experts.kernels.grouped_gemm import grouped_mm_kernel
from dbo.kernels.triton_launch import HAVE_TRITON
from dbo.moe import ActivationFormat, ExpertTokensMetadata, Workspace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _case(m: int, n_local: int, topk: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, hidden, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(n_local, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(n_local, hidden, inter, device="cuda", generator=g) / inter ** 0.5).to(dtype)
    # routed over two ranks' experts; this rank holds [0, n_local), the rest are -1 here
    logits = torch.randn(m, 2 * n_local, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    ids = torch.where(ids < n_local, ids, -1).to(torch.int32)
    return x, w1, w2, weights.float(), ids


def _apply(experts, x, w1, w2, weights, ids, host: bool):
    meta = None
    if host:
        c = torch.bincount(ids[ids >= 0].long().cpu(), minlength=w1.shape[0]).to(torch.int32)
        meta = ExpertTokensMetadata(c.cuda(), c)
    ws = Workspace()

    def call():
        return experts.apply(x, w1, w2, weights, ids, activation_format=ActivationFormat.STANDARD,
                             expert_tokens_meta=meta, apply_router_weight_on_input=False, workspace=ws)

    call()  # warm-up outside the check: Triton compilation, cuBLAS/CUTLASS handles, pinned pool
    with no_host_syncs():
        out = call()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("host", [True, False], ids=["host_counts", "device_offsets"])
@pytest.mark.parametrize("topk", [1, 2, 4, 8])
@pytest.mark.parametrize("reduce_in_experts", [True, False])
def test_apply_has_no_host_sync_and_matches_reference(dtype, host, topk, reduce_in_experts):
    m, n_local, hidden, inter = 300, 16, 512, 128
    x, w1, w2, weights, ids = _case(m, n_local, topk, hidden, inter, dtype, seed=topk)
    ex = SwiGLUExperts(reduce_in_experts=reduce_in_experts)
    out = _apply(ex, x, w1, w2, weights, ids, host)
    if not reduce_in_experts:
        out = (out.float() * weights[..., None]).sum(1)
    ref = reference_moe(x.double(), w1.double(), w2.double(), weights, ids, out_dtype=torch.float64)
    assert relative_error(out, ref) < TOL[dtype]
    kind = grouped_mm_kernel(x, w1)
    assert kind != "loop" or host, f"no sync-free grouped GEMM for {dtype} on this GPU ({kind})"


@pytest.mark.parametrize("host", [True, False], ids=["host_counts", "device_offsets"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_tokens_and_no_local_pairs(host, dtype):
    x, w1, w2, weights, ids = _case(0, 8, 4, 256, 64, dtype, seed=1)
    out = _apply(SwiGLUExperts(), x, w1, w2, weights, ids, host)
    assert out.shape == (0, 256)
    x, w1, w2, weights, ids = _case(50, 8, 4, 256, 64, dtype, seed=2)
    ids.fill_(-1)  # every slot routed to the other rank
    out = _apply(SwiGLUExperts(), x, w1, w2, weights, ids, host)
    assert out.shape == x.shape and not out.any()


@pytest.mark.parametrize("shape", [(4096, 128, 8, 7168, 256), (2000, 64, 8, 2048, 512), (7, 3, 2, 1000, 72)])
def test_benchmark_like_shapes_bf16(shape):
    m, n_local, topk, hidden, inter = shape
    x, w1, w2, weights, ids = _case(m, n_local, topk, hidden, inter, torch.bfloat16, seed=m)
    ref = reference_moe(x.float(), w1.float(), w2.float(), weights, ids, out_dtype=torch.float32) \
        if m < 100 else None
    outs = [_apply(SwiGLUExperts(), x, w1, w2, weights, ids, host) for host in (True, False)]
    assert relative_error(outs[0], outs[1]) < 1e-2  # same kernels, only the offsets' origin differs
    if ref is not None:
        assert relative_error(outs[0], ref) < 2e-2
    else:  # the plain-torch path as the reference at sizes where the float32 loop is too slow
        torch_out = _apply(SwiGLUExperts(use_triton=False), x, w1, w2, weights, ids, True)
        assert relative_error(outs[0], torch_out) < 1e-2


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("m, p, topk, hidden", [(1, 1, 1, 128), (4097, 9000, 8, 7168), (300, 700, 6, 1000)])
def test_triton_kernels_match_torch(m, p, topk, hidden):
    g = torch.Generator(device="cuda").manual_seed(m + p)
    y = torch.randn(p, hidden, device="cuda", generator=g).bfloat16()
    rows = torch.randint(0, p, (m, topk), device="cuda", generator=g)
    w = torch.rand(m, topk, device="cuda", generator=g)
    local = torch.rand(m, topk, device="cuda", generator=g) > 0.4
    out = gather_reduce(y, rows, w, local, use_triton=True)
    ref = gather_reduce(y, rows, w, local, use_triton=False)
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref.float()) < 1e-2
    valid = torch.tensor([p // 2], device="cuda", dtype=torch.int32)
    h = torch.randn(p, 2 * 96, device="cuda", generator=g).bfloat16()
    act = silu_and_mul(h, valid, use_triton=True)
    assert relative_error(act[: p // 2].float(), silu_and_mul(h, use_triton=False)[: p // 2].float()) < 1e-2
    idx = torch.randint(0, p, (p,), device="cuda", generator=g)
    got = gather_rows(y, idx, valid, use_triton=True)
    assert torch.equal(got[: p // 2], y[idx[: p // 2]])


def _fused_cases():
    from dbo.experts.kernels.fused_tiles import (
        CONFIGS,
        FEW_EXPERTS_DOWN,
        FEW_EXPERTS_UP,
        FLAT_DOWN,
        FLAT_DOWN_WIDE,
    )

    cases, seen = [], set()
    for _, up, down, short in CONFIGS:
        for inter, d in ((512, down), (256, short)):
            for persistent in (False, True) if not d.flat else (True,):  # flat: always persistent
                c = (up, d, inter, persistent)
                if c not in seen:
                    seen.add(c)
                    cases.append(c)
    cases.append((FEW_EXPERTS_UP, CONFIGS[0][3], 256, True))
    cases.append((FEW_EXPERTS_UP, FEW_EXPERTS_DOWN, 256, False))
    cases.append((CONFIGS[-1][1], FLAT_DOWN, 200, True))  # K not a multiple of the tile's: TMA's zeros
    cases.append((CONFIGS[-1][1], FLAT_DOWN_WIDE, 512, True))
    return cases


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("m", [700, 9000])  # 5.6K pairs (counting sort), 72K (radix sort, see below)
@pytest.mark.parametrize("case", _fused_cases(), ids=lambda c: f"{c[0].block_m}x{c[0].block_n}"
                         f"-{c[1].block_m}x{c[1].block_n}{'-short' if c[1].n_per_program else ''}"
                         f"{'-flat' if c[1].flat else ''}-{c[0].num_stages}{c[1].num_stages}"
                         f"-I{c[2]}{'-persistent' if c[3] else ''}")
def test_every_fused_tile_matches_torch(case, m, monkeypatch):
    # every tile of the table, one program per tile or persistent: the same numbers as the
    # plain-torch steps; at 72K pairs through the radix sort's int64 order (the counting sort
    # would take 72K pairs of 32 experts: its limit is lowered here)
    from dbo.experts.kernels import fused_route

    if m == 9000:
        monkeypatch.setattr(fused_route, "ROUTE_MAX_CELLS", 2048)
    from dbo.experts.kernels.fused_experts import fused_swiglu_experts

    up, down, inter, persistent = case
    x, w1, w2, weights, ids = _case(m, 32, 8, 1024, inter, torch.bfloat16, seed=m + inter)
    want = _apply(SwiGLUExperts(use_triton=False), x, w1, w2, weights, ids, True)
    out = torch.empty_like(x)
    for check in (False, True):  # the first call compiles outside the check
        with no_host_syncs() if check else contextlib.nullcontext():
            fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(up, down), persistent=persistent)
    torch.cuda.synchronize()
    assert relative_error(out, want) < 1e-2


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("call_persistent", [False, True])
def test_a_tiles_own_persistence_wins_over_the_calls(call_persistent):
    # a tuned table's tiles carry their persistence: each GEMM keeps its own, whatever the call's
    # (a persistent launch sizes its grid from the compiled kernel, cached per specialization)
    import dataclasses

    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels.fused_kernels import down_kernel, gate_up_kernel
    from dbo.experts.kernels.fused_tiles import CONFIGS, DOWN_TAIL

    x, w1, w2, weights, ids = _case(3000, 32, 8, 1024, 512, torch.bfloat16, seed=5)
    want = _apply(SwiGLUExperts(use_triton=False), x, w1, w2, weights, ids, True)
    up = dataclasses.replace(CONFIGS[-1][1], persistent=not call_persistent)
    down = dataclasses.replace(DOWN_TAIL, persistent=not call_persistent)
    out = torch.empty_like(x)
    fe._PER_SM.clear()
    fe.fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(up, down), persistent=call_persistent)
    torch.cuda.synchronize()
    assert relative_error(out, want) < 1e-2
    ran_persistent = {k[0] for k in fe._PER_SM}
    assert (id(gate_up_kernel) in ran_persistent) == (not call_persistent)
    assert (id(down_kernel) in ran_persistent) == (not call_persistent)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("m, n_local", [(9000, 32), (65000, 32), (9000, 256), (70000, 32)])
def test_route_order_both_sorts(m, n_local):
    # the counting sort with many chunks (72K and 520K pairs of 32 experts) and the radix sort
    # (72K pairs of 256 experts, 560K of 32): every local pair once, sorted by expert, the
    # experts' end rows; nothing read back
    from dbo.experts.kernels.fused_route import route_order, uses_counting_sort

    ids = torch.randint(-1, n_local + 2, (m, 8), device="cuda", dtype=torch.int32,
                        generator=torch.Generator(device="cuda").manual_seed(m + n_local))
    assert uses_counting_sort(m * 8, n_local) == ((m, n_local) in ((9000, 32), (65000, 32)))
    route_order(ids, n_local)
    with no_host_syncs():
        order, offsets = route_order(ids, n_local)
    flat = ids.reshape(-1).long()
    local = (flat >= 0) & (flat < n_local)
    rows = order[:int(local.sum())].long()
    assert torch.equal(torch.sort(rows).values, torch.nonzero(local).flatten())
    assert bool((flat[rows][1:] >= flat[rows][:-1]).all())
    assert torch.equal(offsets.long(), torch.cumsum(torch.bincount(flat[local], minlength=n_local), 0))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
def test_direct_launches_match_triton_launches(monkeypatch):
    # the launcher called directly (dbo.kernels.triton_launch) computes what kernel[grid] computes,
    # across specializations (two sizes, a misaligned input), and is what runs after the first call.
    # At m=700 (175 rows per expert) the aligned input runs the split ws gate/up tile, which the
    # misaligned one cannot (the Triton tile): their float32 sums differ in order, not more
    from dbo.experts.kernels.fused_experts import fused_swiglu_experts
    from dbo.kernels import triton_launch

    outs = {}
    for fast in ("0", "1"):
        monkeypatch.setenv("DBO_TRITON_FAST_LAUNCH", fast)
        triton_launch.clear_launch_cache()
        for m in (700, 33):
            x, w1, w2, weights, ids = _case(m, 32, 8, 1024, 256, torch.bfloat16, seed=m)
            xs = torch.empty(m * 1024 + 1, dtype=x.dtype, device="cuda")[1:].view(m, 1024)
            xs.copy_(x)  # 2-byte aligned: another specialization of the gate/up kernel
            for inp in (x, xs):
                out = torch.empty_like(x)
                for _ in range(3):  # a key's first call compiles through kernel[grid]
                    out.fill_(float("nan"))
                    fused_swiglu_experts(inp, w1, w2, weights, ids, out=out)
                outs[(fast, m, inp is xs)] = out.clone()
        assert bool(triton_launch._CACHE) == (fast == "1")
    triton_launch.clear_launch_cache()
    for (fast, m, misaligned), out in outs.items():
        assert torch.equal(out, outs[("0", m, misaligned)]), (fast, m, misaligned)
        assert relative_error(out.float(), outs[(fast, m, False)].float()) < 1e-3, (fast, m, misaligned)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("inter", [256, 768])
def test_misaligned_weights_skip_tma(inter):
    # weights that are views at a 2-byte offset cannot back a TMA descriptor: the fused kernels
    # read them through pointers instead, with the same numbers as the plain-torch steps
    from dbo.experts.kernels.fused_experts import fused_swiglu_experts

    x, w1, w2, weights, ids = _case(700, 8, 8, 1024, inter, torch.bfloat16, seed=inter)
    want = _apply(SwiGLUExperts(use_triton=False), x, w1, w2, weights, ids, True)
    w1m = torch.empty(w1.numel() + 1, dtype=w1.dtype, device="cuda")[1:].view_as(w1).copy_(w1)
    w2m = torch.empty(w2.numel() + 1, dtype=w2.dtype, device="cuda")[1:].view_as(w2).copy_(w2)
    out = torch.empty_like(x)
    fused_swiglu_experts(x, w1m, w2m, weights, ids, out=out)
    torch.cuda.synchronize()
    assert relative_error(out, want) < 1e-2


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("topk, n_local, ranks", [(8, 32, 8), (6, 16, 4), (1, 32, 2), (2, 64, 2)])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_sole_rows_written_by_the_down_kernel_are_the_same_bits(topk, n_local, ranks, weights_dtype):
    # the flat down kernel writing the rows of tokens with one local slot straight to the output
    # (weighted), the top-k sum leaving them alone: bit for bit what the top-k sum writes, with
    # tokens of no, one and several local slots; a top-k that is not a power of two
    from dbo.experts.kernels.fused_experts import fused_swiglu_experts
    from dbo.experts.kernels.fused_tiles import CONFIGS, FLAT_DOWN

    g = torch.Generator(device="cuda").manual_seed(topk + n_local)
    m, hidden, inter = 3000, 1024, 256
    x = torch.randn(m, hidden, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(n_local, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(n_local, hidden, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    logits = torch.randn(m, ranks * n_local, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    ids = torch.where(ids < n_local, ids, -1).to(torch.int32)
    weights = weights.to(weights_dtype)
    per_token = (ids >= 0).sum(1)
    assert bool((per_token == 1).any()) and bool((per_token == 0).any())
    outs = {}
    for sole in (False, True):
        out = torch.full_like(x, float("nan"))
        fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(CONFIGS[-1][1], FLAT_DOWN),
                             sole_pairs=sole)
        with no_host_syncs():
            fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(CONFIGS[-1][1], FLAT_DOWN),
                                 sole_pairs=sole)
        torch.cuda.synchronize()
        outs[sole] = out
    assert torch.equal(outs[True], outs[False])
    want = _apply(SwiGLUExperts(use_triton=False), x, w1, w2, weights.float(), ids, True)
    assert relative_error(outs[True], want) < 1e-2


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("inter, hidden, m, n_local", [(256, 7168, 3000, 32), (768, 1024, 9000, 16),
                                                       (128, 2048, 700, 8)])
@pytest.mark.parametrize("sole", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_warp_specialized_gate_up_is_the_same_bits(block_m, inter, hidden, m, n_local, sole, dtype):
    # the Gluon gate/up kernel (GemmConfig.ws) against the Triton kernel with the same blocks: the
    # same bits, whole calls (its map shared with the flat down kernel at 128 rows, with the sole
    # rows' marks), no host sync; and close to the plain-torch steps
    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels.fused_tiles import FLAT_DOWN, GemmConfig

    ws = GemmConfig(block_m, 128, 64, 8, 8, 4 if block_m == 128 else 5, ws=True)
    x, w1, w2, weights, ids = _case(m, n_local, 8, hidden, inter, dtype, seed=m + inter)
    if not fe.runs_ws(ws, x, w1):
        pytest.skip("the Gluon kernel needs a Hopper GPU and Triton's Gluon")
    outs = []
    for up in (ws, ws.triton_tile()):
        out = torch.full_like(x, float("nan"))
        for check in (False, True):  # the first call compiles outside the check
            with no_host_syncs() if check else contextlib.nullcontext():
                fe.fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(up, FLAT_DOWN),
                                        sole_pairs=sole)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = _apply(SwiGLUExperts(use_triton=False), x.float(), w1.float(), w2.float(), weights, ids, True)
    assert relative_error(outs[0].float(), want) < 1e-2


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
def test_warp_specialized_gate_up_alone_with_empty_experts():
    # launch_gate_up with a ws tile and no map given (it builds its own): the local pairs' rows
    # of act equal the Triton kernel's, with experts of no rows and of one row
    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels.fused_tiles import GemmConfig

    ws = GemmConfig(128, 128, 64, 8, 8, 4, ws=True)
    x, w1, _, _, ids = _case(500, 24, 4, 1024, 256, torch.bfloat16, seed=3)
    ids[ids == 5] = -1  # expert 5 gets no rows
    ids[ids == 7] = -1
    ids[0, 0] = 7  # expert 7 one row
    if not fe.runs_ws(ws, x, w1):
        pytest.skip("the Gluon kernel needs a Hopper GPU and Triton's Gluon")
    order, offsets = fe.route_order(ids, 24)
    pairs = ids.numel()
    acts = []
    for up in (ws, ws.triton_tile()):
        act = torch.full((pairs, 256), float("nan"), dtype=x.dtype, device="cuda")
        fe.launch_gate_up(x, order, offsets, w1, act, up, pairs, 4)
        acts.append(act)
    n = int(offsets[-1])
    assert torch.equal(acts[0][:n], acts[1][:n])
    assert bool(acts[0][n:].isnan().all())  # rows past the local pairs are not written


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("shares, hidden", [(2, 2048), (4, 2048), (8, 2048), (8, 128)])
def test_split_last_round_of_the_warp_specialized_gate_up(block_m, shares, hidden):
    # GemmConfig.split: the tiles of the last round split along K, their float32 partials added
    # by the last share. Against the unsplit kernel: as close as a float32 sum in another order
    # gives, rows past the local pairs untouched, the same bits call after call; over program
    # counts that leave no round partly filled (1), fewer tiles than programs, and partial rounds;
    # at hidden 128 (two K steps) no more shares than K steps
    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels import gluon_gate_up as gg
    from dbo.experts.kernels.fused_tiles import GemmConfig

    x, w1, _, _, ids = _case(2500, 12, 8, hidden, 256, torch.bfloat16, seed=11)
    ws = GemmConfig(block_m, 128, 64, 8, 8, 4 if block_m == 128 else 5, ws=True)
    if not fe.runs_ws(ws, x, w1):
        pytest.skip("the Gluon kernel needs a Hopper GPU and Triton's Gluon")
    order, offsets = fe.route_order(ids, 12)
    pairs = ids.numel()
    tiles, _ = fe.tile_map(offsets, block_m, pairs)
    n = int(offsets[-1])

    def run(programs: int, split: int) -> torch.Tensor:
        act = torch.full((pairs, 256), float("nan"), dtype=x.dtype, device="cuda")
        gg.launch_gate_up_ws(x, order, tiles, w1, act, 8, programs, block_m=block_m, stages=ws.num_stages,
                             split=split)
        return act

    base = run(132, 0)
    for programs in (1, 7, 50, 132, 400):
        got = run(programs, shares)
        assert bool(got[n:].isnan().all())
        assert relative_error(got[:n].float(), base[:n].float()) < 2e-3, programs
        assert torch.equal(run(programs, shares)[:n], got[:n]), programs  # (NaN != NaN past n)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
def test_split_gate_up_whole_call_matches_torch():
    # the table's split tile (few experts, I <= 256) through fused_swiglu_experts: no host sync,
    # close to the plain-torch steps, run to run the same bits
    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels.fused_tiles import FLAT_DOWN, WS_UP64_SPLIT

    x, w1, w2, weights, ids = _case(4000, 16, 8, 2048, 256, torch.bfloat16, seed=5)
    if not fe.runs_ws(WS_UP64_SPLIT, x, w1):
        pytest.skip("the Gluon kernel needs a Hopper GPU and Triton's Gluon")
    outs = []
    for check in (False, True, True):  # the first call compiles outside the check
        out = torch.full_like(x, float("nan"))
        with no_host_syncs() if check else contextlib.nullcontext():
            fe.fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(WS_UP64_SPLIT, FLAT_DOWN))
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[1], outs[2])
    want = _apply(SwiGLUExperts(use_triton=False), x.float(), w1.float(), w2.float(), weights, ids, True)
    assert relative_error(outs[1].float(), want) < 1e-2


def separate_launches(x, w1, w2, tw, ids, out, configs, pairs, sole):
    """The fused call as it ran before ``fused_experts.tile_maps``: the gate/up and the down tile
    each build their map in a launch of their own, and the split's counters are zeroed by one
    (``sole``: the down kernel writes the rows of tokens with one local slot)."""
    from dbo.experts.kernels import fused_experts as fe

    m, topk = ids.shape
    n_experts, two_inter, _ = w1.shape
    up, down = configs
    order, offsets = fe.route_order(ids, n_experts)
    act = torch.empty(m * topk, two_inter // 2, dtype=x.dtype, device=x.device)
    fe.launch_gate_up(x, order, offsets, w1, act, up, pairs, topk)
    y = torch.empty(m * topk, x.shape[1], dtype=x.dtype, device=x.device)
    sole = fe.launch_down(act, order, offsets, w2, y, down, pairs, True, (ids, tw, out) if sole else None)
    fe.launch_topk_sum(y, ids, tw, out, n_experts, sole)
    return out


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("up_name, sole", [("WS_UP64_SPLIT", True), ("WS_UP64_SPLIT", False),
                                           ("WS_UP64", True), ("WS_UP", False)])
def test_one_map_launch_is_the_same_bits_as_separate_launches(up_name, sole):
    # fused_swiglu_experts builds the ws gate/up tile's map, the flat down tile's map (64 and 128
    # rows: two maps, or one), the sole rows' marks and the split's counters in one launch: the
    # same output bits as each built by its own launch, call after call (the counters re-zeroed)
    from dbo.experts.kernels import fused_experts as fe
    from dbo.experts.kernels import fused_tiles as ft

    up = getattr(ft, up_name)
    x, w1, w2, weights, ids = _case(6000, 16, 8, 2048, 256, torch.bfloat16, seed=9)
    ids[:, 4:] = -1  # four slots of eight: tokens with one local slot, and with none
    if not fe.runs_ws(up, x, w1):
        pytest.skip("the Gluon kernel needs a Hopper GPU and Triton's Gluon")
    pairs = ids.numel()
    want = separate_launches(x, w1, w2, weights, ids, torch.full_like(x, float("nan")), (up, ft.FLAT_DOWN),
                             pairs, sole)
    for check in (False, True, True):  # the first call compiles outside the check
        out = torch.full_like(x, float("nan"))
        with no_host_syncs() if check else contextlib.nullcontext():
            fe.fused_swiglu_experts(x, w1, w2, weights, ids, out=out, configs=(up, ft.FLAT_DOWN),
                                    sole_pairs=sole, persistent=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), check


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("m, n_local", [(3000, 32), (9000, 128), (70000, 32)])
def test_route_with_maps_equals_routing_then_maps(m, n_local):
    # the maps, marks and zeros from the counting sort's second launch (or, above its size, the
    # radix sort and then tile_maps) against route_order and tile_maps: the same values
    from dbo.experts.kernels import fused_maps as fm
    from dbo.experts.kernels import fused_route as fr

    _, _, _, _, ids = _case(m, n_local, 8, 64, 64, torch.bfloat16, seed=m)
    pairs = ids.numel()
    zero = torch.full((132,), 5, dtype=torch.int32, device="cuda")
    order, offsets, maps, dest = fr.route_with_maps(ids, n_local, (64, 128), pairs, True, zero)
    want_order, want_offsets = fr.route_order(ids, n_local)
    want_maps, want_dest = fm.tile_maps(want_offsets, (64, 128), pairs, (want_order, ids))
    n = int(want_offsets[-1])
    assert torch.equal(offsets, want_offsets) and not bool(zero.any())
    if fr.uses_counting_sort(pairs, n_local):  # (the radix sort's order within an expert may differ)
        assert torch.equal(order[:n], want_order[:n]) and torch.equal(dest[:n], want_dest[:n])
    for got, want in zip(maps, want_maps, strict=True):
        k = 1 + fm.MAP_ENTRY * int(want[0])
        assert torch.equal(got[:k], want[:k])


# ---- BATCHED_EXPERTS (deepep_ll's slabs) ----------------------------------------------------


def _slabs(n_local: int, cap: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n_local, cap, hidden, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(n_local, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(n_local, hidden, inter, device="cuda", generator=g) / inter ** 0.5).to(dtype)
    counts = torch.randint(0, cap + 1, (n_local,), device="cuda", generator=g).to(torch.int32)
    counts[0], counts[-1] = 0, cap
    return x, w1, w2, counts


def _batched(experts: SwiGLUExperts, x, w1, w2, counts, topk_ids=None) -> torch.Tensor:
    return experts.apply(x, w1, w2, None, topk_ids, activation_format=ActivationFormat.BATCHED_EXPERTS,
                         expert_tokens_meta=ExpertTokensMetadata(counts), apply_router_weight_on_input=False,
                         workspace=Workspace())


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_local,cap,hidden,inter", [(8, 512, 2048, 1024), (3, 100, 256, 128),
                                                      (16, 64, 7168, 2048),
                                                      # few experts at I=2048, 256 rows estimated:
                                                      # the split 64-row and 64x256 flat tiles
                                                      (8, 1024, 2048, 2048)])
def test_batched_slabs_compute_the_rows_that_arrived(dtype, n_local, cap, hidden, inter):
    # the fused kernels over each expert's first counts[e] rows, with no host sync, against the
    # batched matmuls over whole slabs (the same rows); rows past the counts stay unwritten
    x, w1, w2, counts = _slabs(n_local, cap, hidden, inter, dtype, seed=cap)
    want = _batched(SwiGLUExperts(batched_rows=cap), x, w1, w2, counts)
    experts = SwiGLUExperts()
    _batched(experts, x, w1, w2, counts)  # compiles
    with no_host_syncs():
        got = _batched(experts, x, w1, w2, counts).clone()
    for e, c in enumerate(counts.tolist()):
        if c:
            err = relative_error(got[e, :c].float(), want[e, :c].float())
            assert err < TOL[dtype], (e, c, err)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("cap,hidden,inter", [(256, 1024, 512), (1024, 2048, 2048)])
def test_batched_slabs_in_a_cuda_graph_follow_the_counts(cap, hidden, inter):
    # captured once, replayed with other counts: the graph reads them on the device (the second
    # shape takes the few-expert slab tiles, whose split gate/up tile zeroes its counters in the
    # graph)
    from dbo.experts.kernels.batched import batched_swiglu_experts

    x, w1, w2, counts = _slabs(8, cap, hidden, inter, torch.bfloat16, seed=5)
    out = torch.zeros_like(x)
    batched_swiglu_experts(x, w1, w2, counts, out=out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batched_swiglu_experts(x, w1, w2, counts, out=out)
    for seed in range(3):
        counts.copy_(torch.randint(0, cap + 1, (8,), device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).to(torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        want = _batched(SwiGLUExperts(batched_rows=cap), x, w1, w2, counts)
        for e, c in enumerate(counts.tolist()):
            assert bool(out[e, c:].isnan().all()), (seed, e)
            if c:
                err = relative_error(out[e, :c].float(), want[e, :c].float())
                assert err < TOL[torch.bfloat16], (seed, e, err)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_move_rows_on_the_gpu_is_plain_indexing(dtype):
    from dbo.kernels.row_copies import move_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    src = torch.randn(4, 300, 7168 if dtype != torch.float32 else 56, device="cuda", generator=g).to(dtype)
    dst = torch.zeros(2, 700, src.shape[-1], device="cuda").to(dtype)
    s = torch.randperm(1200, device="cuda", generator=g)[:900]
    d = torch.randperm(1400, device="cuda", generator=g)[:900]
    s[::7] = -1
    d[::5] = -1
    want = dst.cpu().clone()
    move_rows(src.cpu(), want, s.cpu(), d.cpu(), row_dims=2, use_triton=False)
    with no_host_syncs():
        move_rows(src, dst, s, d, row_dims=2)
    assert torch.equal(dst.cpu().view(torch.uint8), want.view(torch.uint8))
