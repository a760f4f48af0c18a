"""Single-process tests of the MoE layer: experts, weight-and-reduce, router, kernel protocol."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import dbo
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.experts import SwiGLUExperts, make_expert_weights, reference_moe, relative_error
from dbo.moe import (
    ActivationFormat,
    IdsRangeCheck,
    MoEKernel,
    MoEProtocolError,
    PerUBatch,
    PrepareAndFinalize,
    PrepareResult,
    TopKRouter,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    WorkspacePool,
    check_routing_inputs,
    contiguous_expert_map,
    topk_route,
)

pytestmark = pytest.mark.timeout(60)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(seed: int, m: int, e: int, topk: int, hidden: int = 16, inter: int = 8,
            dtype: torch.dtype = torch.float32, pad_rows: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    weights, ids = topk_route(torch.randn(m, e, generator=g), topk)
    if pad_rows and m:
        ids[::3] = -1
    w1, w2 = make_expert_weights(e, hidden, inter, dtype=dtype, seed=seed)
    return x, weights, ids, w1, w2


def _kernel(fmt: ActivationFormat, reduce_in_experts: bool, use_async: bool = True) -> MoEKernel:
    return MoEKernel(LocalPrepareAndFinalize(fmt, use_async=use_async),
                     SwiGLUExperts(reduce_in_experts=reduce_in_experts))


@given(seed=st.integers(0, 2**16), m=st.integers(0, 24), e=st.sampled_from([1, 4, 8]),
       topk=st.integers(1, 8), fmt=st.sampled_from(list(ActivationFormat)),
       reduce_in_experts=st.booleans(), use_async=st.booleans(), pad_rows=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), cut=st.floats(0, 1))
def test_kernel_matches_reference_plain_and_overlapped(seed, m, e, topk, fmt, reduce_in_experts,
                                                        use_async, pad_rows, dtype, cut):
    topk = min(topk, e)
    x, weights, ids, w1, w2 = _inputs(seed, m, e, topk, dtype=dtype, pad_rows=pad_rows)
    ref = reference_moe(x, w1, w2, weights, ids)
    k = _kernel(fmt, reduce_in_experts, use_async)
    seq = k.forward(x, w1, w2, weights, ids, global_num_experts=e)
    c = int(cut * m)
    outs = dbo.run_ubatches(
        [lambda: k.forward(x[:c], w1, w2, weights[:c], ids[:c], global_num_experts=e),
         lambda: k.forward(x[c:], w1, w2, weights[c:], ids[c:], global_num_experts=e)],
        device="cpu")
    ovl = torch.cat(outs)
    errs = relative_error(seq, ref), relative_error(ovl, ref), relative_error(ovl, seq)
    note(f"errors seq/ovl/ovl-vs-seq: {errs}")
    assert seq.dtype == dtype and seq.shape == x.shape
    assert max(errs) <= TOL[dtype]


def test_router_on_input_and_expert_map():
    x, weights, ids, w1, w2 = _inputs(3, 10, 8, 1)
    ref = reference_moe(x, w1, w2, weights, ids, apply_router_weight_on_input=True)
    k = _kernel(ActivationFormat.STANDARD, True)
    out = k.forward(x, w1, w2, weights, ids, global_num_experts=8, apply_router_weight_on_input=True)
    assert relative_error(out, ref) <= 1e-5
    # only the experts of "rank 1 of 2" are local: the others contribute nothing
    emap = contiguous_expert_map(8, 2, 1)
    x, weights, ids, w1, w2 = _inputs(4, 12, 8, 3)
    masked = torch.where(ids >= 4, ids, -1)
    ref = reference_moe(x, w1, w2, weights, masked)
    out = k.forward(x, w1[4:], w2[4:], weights, ids, global_num_experts=8, expert_map=emap)
    assert relative_error(out, ref) <= 1e-5


def test_shared_experts_run_while_combine_in_flight():
    x, weights, ids, w1, w2 = _inputs(5, 8, 4, 2)
    calls = []

    def shared(h):
        calls.append(dbo.dbo_current_ubatch_id())
        return 2 * h

    k = MoEKernel(LocalPrepareAndFinalize(), SwiGLUExperts(), shared_experts=shared)
    trace = dbo.Trace()
    outs = dbo.run_ubatches([lambda: k(x[:4], w1, w2, weights[:4], ids[:4], global_num_experts=4),
                             lambda: k(x[4:], w1, w2, weights[4:], ids[4:], global_num_experts=4)],
                            device="cpu", trace=trace)
    ref = reference_moe(x, w1, w2, weights, ids) + 2 * x
    assert relative_error(torch.cat(outs), ref) <= 1e-5
    assert sorted(calls) == [0, 1]
    names = [(e.ubatch, e.detail) for e in trace.events if e.kind == "region_begin"]
    # per ubatch: the combine is issued before the shared experts, whose result comes after
    for ub in (0, 1):
        mine = [n for u, n in names if u == ub]
        assert mine.index("combine") < mine.index("shared_experts") < mine.index("combine_recv")


class _RecordingBackend(LocalPrepareAndFinalize):
    """Records the order of issue / hook / receive, to check the kernel's hook protocol."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def prepare_async(self, *args, **kwargs):
        ub = dbo.dbo_current_ubatch_id()
        self.log.append(("dispatch_issue", ub))
        hook, recv = super().prepare_async(*args, **kwargs)
        return (lambda: self.log.append(("dispatch_hook", ub, dbo.dbo_current_ubatch_id())),
                lambda: (self.log.append(("dispatch_recv", ub)), recv())[1])

    def finalize_async(self, *args, **kwargs):
        ub = dbo.dbo_current_ubatch_id()
        self.log.append(("combine_issue", ub))
        super().finalize_async(*args, **kwargs)
        return (lambda: self.log.append(("combine_hook", ub, dbo.dbo_current_ubatch_id())),
                lambda: self.log.append(("combine_recv", ub)))


def test_kernel_hook_protocol_yields_after_issue():
    x, weights, ids, w1, w2 = _inputs(6, 8, 4, 2)
    log: list = []
    k = MoEKernel(_RecordingBackend(log), SwiGLUExperts())
    dbo.run_ubatches([lambda: k(x[:4], w1, w2, weights[:4], ids[:4], global_num_experts=4),
                      lambda: k(x[4:], w1, w2, weights[4:], ids[4:], global_num_experts=4)],
                     device="cpu")
    # ub0 issues its dispatch and yields; ub1 runs ub0's hook before issuing its own
    assert log[:3] == [("dispatch_issue", 0), ("dispatch_hook", 0, 1), ("dispatch_issue", 1)]
    for ub in (0, 1):
        for phase in ("dispatch", "combine"):
            hook = next(i for i, e in enumerate(log) if e[0] == f"{phase}_hook" and e[1] == ub)
            issue = log.index((f"{phase}_issue", ub))
            recv = log.index((f"{phase}_recv", ub))
            assert issue < hook < recv
    # without DBO the hook runs in place, right after the issue
    log.clear()
    k(x, w1, w2, weights, ids, global_num_experts=4)
    assert [e[0] for e in log] == ["dispatch_issue", "dispatch_hook", "dispatch_recv",
                                   "combine_issue", "combine_hook", "combine_recv"]


def test_workspaces_are_per_ubatch():
    x, weights, ids, w1, w2 = _inputs(7, 8, 4, 2)
    k = _kernel(ActivationFormat.STANDARD, True)
    seen = {}

    def body(ub_slice):
        k(x[ub_slice], w1, w2, weights[ub_slice], ids[ub_slice], global_num_experts=4)
        seen[dbo.dbo_current_ubatch_id()] = k.workspace()

    dbo.run_ubatches([lambda: body(slice(0, 4)), lambda: body(slice(4, 8))], device="cpu")
    assert seen[0] is not seen[1]
    assert seen[0]._bufs["fused_out"].data_ptr() != seen[1]._bufs["fused_out"].data_ptr()
    k.reset()
    assert k.workspaces._ubatches == []


def test_layers_sharing_a_pool_keep_one_layers_scratch_and_the_same_results():
    """Two layers in sequence (the second's input is the first's output), overlapped: with one
    pool the second layer reuses the first's buffers, and the result is the one with a pool per
    layer, and the plain one's."""
    x, weights, ids, w1, w2 = _inputs(11, 8, 4, 2)
    w1b, w2b = make_expert_weights(4, 16, 8, seed=12)

    def model(kernels):
        def body(sl):
            h = kernels[0](x[sl], w1, w2, weights[sl], ids[sl], global_num_experts=4)
            return kernels[1](h, w1b, w2b, weights[sl], ids[sl], global_num_experts=4)
        return body

    pool = WorkspacePool()
    shared = [MoEKernel(LocalPrepareAndFinalize(ActivationFormat.STANDARD), SwiGLUExperts(),
                        workspaces=pool) for _ in range(2)]
    own = [_kernel(ActivationFormat.STANDARD, False) for _ in range(2)]
    plain = model(own)(slice(0, 8))
    outs = {}
    for name, kernels in (("shared", shared), ("own", own)):
        body = model(kernels)
        outs[name] = torch.cat(dbo.run_ubatches([lambda b=body: b(slice(0, 4)),
                                                 lambda b=body: b(slice(4, 8))], device="cpu"))
    torch.testing.assert_close(outs["shared"], outs["own"], rtol=0, atol=0)
    torch.testing.assert_close(outs["shared"], plain, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    assert shared[0].workspace() is shared[1].workspace() is pool.ubatch(0)
    assert own[0].workspace() is not own[1].workspace()
    assert len(pool._ubatches) == 2 and set(pool.ubatch(1)._bufs) == set(pool.ubatch(0)._bufs)
    with pytest.raises(TypeError, match="WorkspacePool"):
        MoEKernel(LocalPrepareAndFinalize(ActivationFormat.STANDARD), SwiGLUExperts(), workspaces={})
    assert WorkspacePool.of_device("cpu") is WorkspacePool.of_device(torch.device("cpu"))
    # the device's pool lives while a kernel holds it: deleting the model frees its buffers
    import gc
    import weakref

    k = MoEKernel(LocalPrepareAndFinalize(ActivationFormat.STANDARD), SwiGLUExperts(),
                  workspaces=WorkspacePool.of_device("cpu"))
    k(x, w1, w2, weights, ids, global_num_experts=4)
    held = weakref.ref(k.workspaces)
    assert WorkspacePool.of_device("cpu") is held()
    del k
    gc.collect()
    assert held() is None


def test_weight_and_reduce_variants():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 4, generator=g)
    w = torch.rand(5, 3, generator=g)
    ids = torch.tensor([[0, 1, -1]] * 5)
    out = TopKWeightAndReduceContiguous().apply(None, y, w, ids, False)
    want = (y[:, :2] * w[:, :2, None]).sum(1)
    assert torch.allclose(out, want, atol=1e-6)
    buf = torch.empty(5, 4)
    assert TopKWeightAndReduceContiguous().apply(buf, y.view(15, 4), w, ids, True) is buf
    assert torch.allclose(buf, y[:, :2].sum(1), atol=1e-6)
    flat = torch.randn(5, 4)
    assert TopKWeightAndReduceNoOp().apply(None, flat, w, ids, False) is flat
    with pytest.raises(RuntimeError, match="Delegate"):
        TopKWeightAndReduceDelegate().apply(None, flat, w, ids, False)
    with pytest.raises(ValueError, match="fused_expert_output"):
        TopKWeightAndReduceContiguous().apply(None, torch.randn(5, 2, 4), w, ids, False)


def test_router():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, i = topk_route(logits, 2)
    assert i.tolist() == [[3, 2]] and i.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.allclose(w.sum(-1), torch.ones(1))
    w, _ = topk_route(logits, 2, renormalize=False)
    assert w.sum() < 1
    r = TopKRouter(torch.eye(4), 1, ids_dtype=torch.int64)
    w, i = r(torch.tensor([[0.0, 5.0, 0.0, 0.0]]))
    assert i.tolist() == [[1]] and i.dtype == torch.int64 and r.num_experts == 4
    with pytest.raises(ValueError, match="topk"):
        topk_route(logits, 5)
    with pytest.raises(ValueError, match="router_logits"):
        topk_route(torch.zeros(4), 1)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: {**a, "a1": a["a1"].double()}, TypeError, "hidden_states"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].half()}, TypeError, "topk_weights"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, TypeError, "topk_ids"),
    (lambda a: {**a, "topk_ids": a["topk_ids"] + 8}, ValueError, "topk_ids must lie"),
    (lambda a: {**a, "topk_ids": a["topk_ids"] - 5}, ValueError, "topk_ids must lie"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, ValueError, "topk_ids must be"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, ValueError, "topk_weights has shape"),
    (lambda a: {**a, "a1": a["a1"][:, :0]}, ValueError, "hidden size 0"),
    (lambda a: {**a, "a1": a["a1"][0]}, ValueError, "hidden_states"),
    (lambda a: {**a, "num_experts": 0}, ValueError, "num_experts"),
    (lambda a: {**a, "hidden_size": 32}, ValueError, "hidden_size=32"),
    (lambda a: {**a, "apply_router_weight_on_input": True}, ValueError, "topk == 1"),
])
def test_routing_input_checks(mutate, exc, match):
    x, weights, ids, _, _ = _inputs(0, 6, 8, 2)
    args = {"a1": x, "topk_weights": weights, "topk_ids": ids, "num_experts": 8}
    args = mutate(args)
    with pytest.raises(exc, match=match):
        check_routing_inputs(args.pop("a1"), args.pop("topk_weights"), args.pop("topk_ids"),
                             args.pop("num_experts"), **args)


def test_ids_range_read_once_on_a_device_every_call_on_cpu():
    """The range check reads device ids (a host sync) at the first call only; CPU ids always."""
    on_device = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    once, always = IdsRangeCheck(), IdsRangeCheck(every_call=True)
    assert [once(on_device) for _ in range(3)] == [True, False, False]
    assert [always(on_device) for _ in range(3)] == [True, True, True]
    assert [once(torch.zeros(2, 2, dtype=torch.int32)) for _ in range(2)] == [True, True]
    # so a CPU backend still refuses bad ids at every call, not only the first
    pf = LocalPrepareAndFinalize()
    x, weights, ids, _, _ = _inputs(0, 6, 8, 2)
    pf.prepare(x, weights, ids, 8, None, False)
    for _ in range(2):
        with pytest.raises(ValueError, match="topk_ids must lie"):
            pf.prepare(x, weights, ids + 8, 8, None, False)


def test_kernel_argument_errors():
    with pytest.raises(TypeError, match="prepare_finalize"):
        MoEKernel(object(), SwiGLUExperts())
    with pytest.raises(TypeError, match="experts"):
        MoEKernel(LocalPrepareAndFinalize(), object())
    x, weights, ids, w1, w2 = _inputs(1, 4, 4, 2)
    k = _kernel(ActivationFormat.STANDARD, True)
    with pytest.raises(ValueError, match="w2"):
        k(x, w1, w2[:, :, :3], weights, ids, global_num_experts=4)
    with pytest.raises(TypeError, match="w1/w2 dtypes"):
        k(x, w1.double(), w2.double(), weights, ids, global_num_experts=4)


def test_per_ubatch_handles_protocol():
    slots: PerUBatch[int] = PerUBatch("test handle")
    with pytest.raises(MoEProtocolError, match="no prepare"):
        slots.take()
    slots.put(1)
    slots.put(2)  # a stale value from a failed step is replaced
    with pytest.raises(MoEProtocolError, match="twice"):
        slots.put(3, strict=True)
    got = dbo.run_ubatches([lambda: (slots.put(10), dbo.dbo_yield(), slots.take())[2],
                            lambda: (slots.put(11), dbo.dbo_yield(), slots.take())[2]],
                           device="cpu")
    assert got == [10, 11] and len(slots) == 0
    with pytest.raises(MoEProtocolError):
        LocalPrepareAndFinalize(ActivationFormat.BATCHED_EXPERTS).finalize(
            torch.zeros(1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int32),
            False, TopKWeightAndReduceDelegate())


def test_sync_only_backend_uses_prepare_and_finalize():
    class SyncOnly(PrepareAndFinalize):
        activation_format = ActivationFormat.STANDARD

        def num_dispatchers(self):
            return 1

        def output_is_reduced(self):
            return False

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config=None):
            return PrepareResult(a1, None, None, topk_ids, topk_weights)

        def finalize(self, output, fused, topk_weights, topk_ids, on_input, wr):
            output.copy_(fused)

    pf = SyncOnly()
    assert not pf.supports_async()
    x, weights, ids, w1, w2 = _inputs(2, 6, 4, 2)
    out = MoEKernel(pf, SwiGLUExperts())(x, w1, w2, weights, ids, global_num_experts=4)
    assert relative_error(out, reference_moe(x, w1, w2, weights, ids)) <= 1e-5
