"""The emulated rank on CPU: one process plays rank r of an N-rank group with DeepEP's
low-latency and normal layouts, under the real DeepEP backends; its layer equals the
single-process MoE of its local experts with the stand-in routing, plain and overlapped, over
every expert schedule (the conformance suite), and the bytes it sends are those of the rank it
plays."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from dbo.backends import BACKENDS, make_backend
from dbo.backends.emulated import EMULATED, EmulatedBuffer, EmulatedGroup
from dbo.backends.simulated_link import SimulatedLink
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
from dbo.moe import MoEKernel
from dbo.moe.validate import stand_in_local_ids
from dbo.testing.conformance import ConformanceCase, run_case
from dbo.ubatch.context import run_ubatches

HIDDEN = 2048  # the smallest hidden size DeepEP's low-latency kernels take


@pytest.fixture(autouse=True)
def _free_buffers():
    yield
    EMULATED.reset()


def _backend(layout: str, n: int, experts: int, topk: int, tokens: int, rank: int = 0, **kw):
    return make_backend("emulated", None, hidden=HIDDEN, num_experts=experts, topk=topk,
                        dtype=torch.bfloat16, device="cpu", max_tokens_per_rank=max(tokens, 1),
                        ep_size=n, rank=rank, layout=layout, **kw)


@settings(max_examples=12, deadline=None)
@given(layout=st.sampled_from(["deepep_ll", "deepep_ht"]), n=st.sampled_from([2, 4, 8, 16]),
       n_local=st.sampled_from([1, 2, 4]), topk=st.integers(1, 6), tokens=st.integers(0, 12),
       holes=st.integers(0, 4), seed=st.integers(0, 1000))
def test_the_emulated_rank_is_its_local_experts_moe_plain_and_overlapped(layout, n, n_local, topk,
                                                                        tokens, holes, seed):
    experts = n * n_local
    topk = min(topk, experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(n_local, 64, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(n_local, HIDDEN, 32, generator=g) * 0.05).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk)
    for h in range(min(holes, tokens * topk)):  # pairs with no expert
        ids.view(-1)[(h * 7) % (tokens * topk)] = -1
    note(f"layout={layout} N={n} L={n_local} topk={topk} T={tokens} ids={ids.tolist()}")
    EMULATED.reset()  # a buffer per shape, as a real group would make for another model
    kernel = MoEKernel(_backend(layout, n, experts, topk, tokens, rank=seed % n), SwiGLUExperts())

    def call(lo, hi):
        return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=experts)

    plain = call(0, tokens)
    ref = reference_moe(x, w1, w2, weights, stand_in_local_ids(ids, experts, n))
    assert relative_error(plain, ref) < 2e-2
    cut = tokens // 2
    dbo = torch.cat(run_ubatches([lambda: call(0, cut), lambda: call(cut, tokens)]))
    assert relative_error(dbo, plain) < 1e-2


def _factory(case: ConformanceCase):
    opts = dict(case.options)
    return _backend(opts["layout"], opts["n"], case.num_experts, case.topk, max(case.num_tokens),
                    rank=opts.get("rank", 0))


@pytest.mark.parametrize("layout,schedule", [("deepep_ll", "split"), ("deepep_ll", "merged"),
                                             ("deepep_ll", "sbo"), ("deepep_ll", "sbo+dbo"),
                                             ("deepep_ht", "split"), ("deepep_ht", "merged")])
def test_the_conformance_suite_passes_on_an_emulated_rank_without_a_process_group(layout, schedule):
    for topk, tokens in ((2, 24), (4, 17), (2, 0)):
        case = ConformanceCase(f"{layout} {schedule} k={topk} T={tokens}", (tokens,) * 4, HIDDEN, topk, 16,
                               expert_schedule=schedule, sbo_groups=2, seed=topk + tokens,
                               options=(("layout", layout), ("n", 4), ("rank", 3)))
        result = run_case(_factory, case)
        assert result.ok, result.problems


def test_the_link_is_served_inside_and_counts_the_bytes_that_leave_the_host():
    # 16 ranks over 2 hosts: rank 0's pairs for experts of ranks 8-15 leave the host
    link = SimulatedLink(1.0, 0.0, combine_latency_us=0.0)  # 1 GB/s: 1 kB = 1 us
    pf = _backend("deepep_ll", 16, 32, 2, 8, link=link)
    assert type(pf).__name__ == "DeepEPLLPrepareAndFinalize"  # not wrapped: the link is inside
    buf = pf.buffer
    assert isinstance(buf, EmulatedBuffer) and buf.link is link
    ids = torch.tensor([[0, 16], [2, 31], [20, 21], [1, 3]])  # remote pairs: 16, 31, 20, 21
    rows, per_key, dest = buf.pair_rows(ids, 32, 16 * 8)
    share = buf.remote_share
    assert float(share[dest].sum()) == 4.0
    assert per_key.sum() == 8 and per_key.shape == (2, 16)
    # the stand-in: pair (t, e) arrives from rank e // 2 at local expert e % 2
    want = torch.zeros(2, 16, dtype=torch.int64)
    for e in (0, 16, 2, 31, 20, 21, 1, 3):
        want[e % 2, e // 2] += 1
    assert torch.equal(per_key, want)
    # each local expert's rows in (source rank, token) order, packed from the slab's start
    assert sorted(rows.tolist()) == [0, 1, 2, 3, 128, 129, 130, 131]


def test_normal_mode_sends_one_row_per_token_and_remote_host():
    buf = EmulatedBuffer(EmulatedGroup(16, 0, 8), device="cpu")
    in_rank = torch.zeros(3, 16, dtype=torch.bool)
    in_rank[0, [1, 9, 10]] = True  # host 1 twice: one row over the link
    in_rank[1, [2]] = True  # stays on the host
    in_rank[2, [8, 15]] = True
    assert float(buf.rows_off_host(in_rank)) == 2.0
    shared = EmulatedBuffer(EmulatedGroup(4, 1, 8), device="cpu", remote_fraction=0.5)
    assert float(shared.rows_off_host(in_rank[:, :4])) == 0.5  # (token 0, rank... ) rows to others x 0.5


def test_bad_options_are_named():
    assert BACKENDS["emulated"].serves_link and BACKENDS["emulated"].emulated
    with pytest.raises(ValueError, match="layout"):
        _backend("deepep_v2", 4, 8, 2, 8)
    with pytest.raises(ValueError, match="ep_size"):
        _backend("deepep_ll", 3, 8, 2, 8)
    with pytest.raises(ValueError, match="ep_size"):
        _backend("deepep_ll", 1, 8, 2, 8)
    with pytest.raises(TypeError, match="bf16"):
        make_backend("emulated", None, hidden=HIDDEN, num_experts=8, topk=2, dtype=torch.float32,
                     device="cpu", max_tokens_per_rank=8, ep_size=4)
    with pytest.raises(ValueError, match="rank"):
        _backend("deepep_ll", 4, 8, 2, 8, rank=4)
    with pytest.raises(ValueError, match="remote_fraction"):
        _backend("deepep_ll", 4, 8, 2, 8, remote_fraction=1.5)


@settings(max_examples=6, deadline=None)
@given(imbalance=st.sampled_from([1.25, 1.5, 2.0, 3.0]), tokens=st.integers(1, 12), seed=st.integers(0, 100))
@example(imbalance=3.0, tokens=1, seed=1)  # a token's pairs three times over in one expert's slab
def test_a_hot_rank_computes_more_rows_and_sends_more_bytes_with_the_same_output(imbalance, tokens, seed):
    n, experts, topk = 4, 16, 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(4, 64, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4, HIDDEN, 32, generator=g) * 0.05).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk)
    outs, rows, sent = {}, {}, {}
    for f in (1.0, imbalance):
        EMULATED.reset()
        pf = _backend("deepep_ll", n, experts, topk, tokens, rank=1, imbalance=f)
        buf = pf.buffer
        kernel = MoEKernel(pf, SwiGLUExperts())

        def call(lo, hi, kernel=kernel):
            return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=experts)
        outs[f] = call(0, tokens)
        rows[f] = int(buf._ll_slots[buf._ll_next ^ 1]["count"].sum())  # the slot that call used
        sent[f] = int(buf.remote_units(ids, experts // n, extra=buf.extra_pairs(tokens * topk)))
        cut = tokens // 2
        outs[(f, "dbo")] = torch.cat(run_ubatches([lambda c=call, m=cut: c(0, m),
                                                   lambda c=call, m=cut: c(m, tokens)]))
    assert torch.equal(outs[imbalance], outs[1.0])  # the extra rows are not summed into its tokens
    assert relative_error(outs[(imbalance, "dbo")], outs[1.0]) < 1e-2
    extra = round((imbalance - 1) * tokens * topk)
    note(f"rows {rows} sent {sent} extra {extra}")
    assert rows[1.0] == tokens * topk and rows[imbalance] == tokens * topk + extra
    assert sent[imbalance] * tokens * topk == sent[1.0] * (tokens * topk + extra) or sent[1.0] == 0


def test_imbalance_is_checked():
    with pytest.raises(ValueError, match="imbalance"):
        _backend("deepep_ll", 4, 8, 2, 8, imbalance=0.5)
    with pytest.raises(ValueError, match="deepep_ll"):
        _backend("deepep_ht", 4, 8, 2, 8, imbalance=1.5)


@pytest.mark.parametrize("imbalance", [1.0, 2.5])
def test_a_copied_handle_finds_rows_holding_each_pairs_expert_and_token(imbalance):
    # sbo+dbo copies the handle out of the buffer; the combine then finds each pair's row from
    # the handle alone, a row of the same local expert holding the same token
    n, experts, t, k = 4, 16, 10, 3
    buf = EmulatedBuffer(EmulatedGroup(n, 1, 8), low_latency_mode=True, imbalance=imbalance)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    ids[2, 1] = -1
    x = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 3 * t, experts, use_fp8=False)
    own = buf._slot_of(handle[0])["pair_rows"]
    src, ranges = handle[0].clone(), handle[1].clone()
    for second in (ranges, (ranges & 0xFFFFFFFF).sum(1).to(torch.int32)):  # a group combine's counts
        rows = buf._rows_from_handle((src, second, *handle[2:]), ids, buf.extra_pairs(t * k))
        assert rows.shape == own.shape
        cap = n * 3 * t
        flat = src.reshape(-1)
        assert torch.equal(rows // cap, own // cap) and torch.equal(flat[rows].long(), flat[own].long())


_HT_LAYOUT_SCRIPT = r"""
import torch
from dbo.backends.emulated import EmulatedBuffer, EmulatedGroup, kernels

g = torch.Generator().manual_seed(0)
for n, gph, n_local, k, t, rank in [(4, 2, 2, 2, 1, 3), (16, 8, 4, 8, 37, 9), (32, 8, 8, 8, 300, 0),
                                    (8, 8, 1, 3, 50, 5), (64, 8, 1, 8, 129, 63), (2, 1, 3, 2, 17, 1)]:
    experts = n * n_local
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < 0.2] = -1  # padding and masked pairs
    buf = EmulatedBuffer(EmulatedGroup(n, rank, gpus_per_host=gph))
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, experts)  # the torch route
    flat = in_rank.t().reshape(-1)
    local = torch.bincount(torch.remainder(ids[ids >= 0], n_local), minlength=n_local)
    lay = kernels.ht_layout(ids, n=n, n_local=n_local, num_hosts=buf.num_hosts, rank=rank)
    case = (n, gph, n_local, k, t, rank)
    assert torch.equal(lay.in_rank, in_rank), case
    assert torch.equal(lay.per_rank, per_rank) and torch.equal(lay.per_expert, per_expert), case
    assert (lay.per_host is None) == (per_host is None), case
    assert per_host is None or torch.equal(lay.per_host, per_host), case
    assert torch.equal(lay.pos, torch.cumsum(flat.to(torch.int64), 0) - 1), case
    assert lay.counts.tolist() == [int(flat.sum())] + local.tolist(), case
    if buf.num_hosts > 1:
        assert torch.equal(lay.units, buf._quantized(buf.rows_off_host(in_rank))), case
    assert int(lay.other) == int((in_rank & buf._other_rank).sum()), case
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(300)
def test_the_normal_mode_layout_kernels_count_as_the_torch_route():
    # the two launches of a normal-mode dispatch's layout, run by Triton's CPU interpreter,
    # against the torch route: tables, counts, received rows and the bytes off the host
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _HT_LAYOUT_SCRIPT], cwd=root, capture_output=True,
                          text=True, timeout=280, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


_HT_FUSED_SCRIPT = r"""
import torch
from dbo.backends import make_backend
from dbo.backends.emulated import EMULATED, kernels
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
from dbo.moe import MoEKernel
from dbo.moe.validate import stand_in_local_ids
from dbo.ubatch.context import run_ubatches

hidden = 2048
for n, n_local, topk, tokens, rank in [(4, 2, 2, 13, 3), (16, 1, 4, 40, 0), (8, 4, 3, 1, 5)]:
    experts = n * n_local
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(n_local, 64, hidden, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(n_local, hidden, 32, generator=g) * 0.05).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk)
    ids.view(-1)[::5] = -1
    outs = {}
    for fused in (False, True):
        # the layout's kernels (they take the routing: int64); the receive and the combine keep the
        # torch route, their kernels' loops over loaded values being beyond the interpreter
        kernels.usable = (lambda t: not t.is_floating_point()) if fused else (lambda t: False)
        EMULATED.reset()
        pf = make_backend("emulated", None, hidden=hidden, num_experts=experts, topk=topk,
                          dtype=torch.bfloat16, device="cpu", max_tokens_per_rank=tokens, ep_size=n,
                          rank=rank, layout="deepep_ht")
        kernel = MoEKernel(pf, SwiGLUExperts())

        def call(lo, hi):
            return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=experts)

        cut = tokens // 2
        outs[fused] = (call(0, tokens),
                       torch.cat(run_ubatches([lambda: call(0, cut), lambda: call(cut, tokens)])))
    ref = reference_moe(x, w1, w2, weights, stand_in_local_ids(ids, experts, n))
    plain, dbo = outs[True]
    assert relative_error(plain, ref) < 2e-2, (n, tokens)
    assert relative_error(dbo, plain) < 1e-2, (n, tokens)
    assert torch.equal(plain, outs[False][0]), (n, tokens)  # the torch route's layer
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(300)
def test_a_normal_mode_layer_on_the_kernels_is_the_torch_routes_layer():
    # the layout's kernels through the buffer (their table, received rows, counts and bytes handed
    # to the dispatch and its combine), run by Triton's CPU interpreter, plain and overlapped
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _HT_FUSED_SCRIPT], cwd=root, capture_output=True,
                          text=True, timeout=280, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
