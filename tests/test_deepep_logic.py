"""Logic of the DeepEP backends against the fake ``deep_ep`` on gloo: which stream each DeepEP
call runs on and with which events, the hook flow, the low-latency limits, and error paths.

Every numerical check compares the overlapped run with the plain one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo import run_ubatches
from dbo.errors import UBatchError
from dbo.experts.reference import local_expert_weights, make_expert_weights
from dbo.experts.swiglu import SwiGLUExperts
from dbo.moe.kernel import MoEKernel
from dbo.moe.router import topk_route
from dbo.moe.weight_and_reduce import TopKWeightAndReduceContiguous, TopKWeightAndReduceNoOp
from dbo.testing.fake_deep_ep import FakeDeepEPError, ensure_fake_deep_ep, fake_deepep_backend

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

E, H, K = 8, 256, 2


def _backend(kind: str, api: str = "v1", **kw):
    kw.setdefault("max_tokens_per_rank", 16)
    return fake_deepep_backend(kind, api=api, hidden=H, num_experts=E, topk=K,
                               dtype=torch.bfloat16, device="cpu", **kw)


def _inputs(n: int = 16, seed: int = 0):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(n, E, generator=g), K, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(E, H, 32, dtype=torch.bfloat16, seed=seed)
    return x, weights, ids, local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)


def _forward(kernel, x, weights, ids, w1, w2, ubatches: int = 0):
    def layer(s=slice(None)):
        return kernel(x[s], w1, w2, weights[s], ids[s], global_num_experts=E)

    if not ubatches:
        return layer()
    n = x.shape[0]
    cut = [round(i * n / ubatches) for i in range(ubatches + 1)]
    outs = run_ubatches([(lambda s=slice(cut[i], cut[i + 1]): layer(s)) for i in range(ubatches)],
                        device="cpu")
    return torch.cat(outs)


# ---- which stream, which events ----------------------------------------------------------


def _stream_protocol(kind: str, api: str = "v1"):
    pf = _backend(kind, api, **({"mode": "decode"} if kind == "v2" else {}))
    kernel = MoEKernel(pf, SwiGLUExperts())
    x, weights, ids, w1, w2 = _inputs()
    calls = pf.buffer.calls
    start = len(calls)
    serial = _forward(kernel, x, weights, ids, w1, w2)
    mid = len(calls)
    overlapped = _forward(kernel, x, weights, ids, w1, w2, ubatches=2)
    return serial, overlapped, calls[start:mid], calls[mid:]


def test_ht_calls_deepep_from_the_comm_stream_with_the_captured_event(world2):
    for serial, overlapped, plain, dbo in world2.run(_stream_protocol, "ht"):
        assert torch.equal(serial, overlapped)
        assert [c["method"] for c in plain] == ["get_dispatch_layout", "dispatch", "combine"]
        # without DBO: asynchronous, from the caller's stream; dispatch waits on the layout event
        assert all(c["stream"] == "compute" and c["async_finish"] for c in plain)
        assert [c["previous_event"] for c in plain] == [False, True, False]
        # under DBO: after the yield, from the comm stream, waiting on the compute-stream event
        assert len(dbo) == 6
        assert all(c["stream"] == "comm" and c["previous_event"] and not c["async_finish"] for c in dbo)


def test_ll_uses_recv_hooks_on_the_compute_stream_under_dbo(world2):
    for serial, overlapped, plain, dbo in world2.run(_stream_protocol, "ll"):
        assert torch.equal(serial, overlapped)
        assert [c["method"] for c in plain] == ["low_latency_dispatch", "low_latency_combine"]
        assert all(c["async_finish"] and not c["return_recv_hook"] for c in plain)
        assert len(dbo) == 4
        assert all(c["stream"] == "compute" and c["return_recv_hook"] and not c["async_finish"]
                   for c in dbo)


@pytest.mark.parametrize("api", ["v2-elastic", "v2-ep"])
def test_v2_calls_from_the_comm_stream_with_the_captured_event(world2, api):
    for serial, overlapped, plain, dbo in world2.run(_stream_protocol, "v2", api):
        assert torch.equal(serial, overlapped)
        assert [c["method"] for c in plain] == ["dispatch", "combine"]
        assert all(c["stream"] == "compute" and not c["previous_event"] for c in plain)
        assert all(c["stream"] == "comm" and c["previous_event"] for c in dbo) and len(dbo) == 4


# ---- the low-latency limits ---------------------------------------------------------------


def _ll_three_ubatches():
    pf = _backend("ll")
    kernel = MoEKernel(pf, SwiGLUExperts())
    x, weights, ids, w1, w2 = _inputs(12)
    try:
        _forward(kernel, x, weights, ids, w1, w2, ubatches=3)
    except UBatchError as exc:
        msg = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    else:
        msg = "no error"
    # ubatches 0 and 1 launched their dispatches before ubatch 2 was refused: drain them
    pending = list(pf.results._alive)
    pf.reset()
    return msg, pending


def test_ll_refuses_a_third_live_result(world2):
    for msg, _pending in world2.run(_ll_three_ubatches):
        assert msg.startswith("LowLatencyLimitError") and "third low-latency result" in msg, msg
        assert "at most 2 ubatches" in msg
    world2.restart()  # the two abandoned dispatches left gloo work behind


def _ll_launch_with_pending_receive():
    pf = _backend("ll")
    x, weights, ids, _, _ = _inputs(8)
    hooks = []

    def ub0():
        hooks.append(pf.prepare_async(x, weights, ids, E, None, False))  # hook not registered
        from dbo import dbo_yield
        dbo_yield()

    def ub1():
        pf.prepare_async(x, weights, ids, E, None, False)

    try:
        run_ubatches([ub0, ub1], device="cpu")
        msg = "no error"
    except UBatchError as exc:
        msg = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    hook, receiver = hooks[0]
    hook()  # both ranks drain the one launched dispatch
    out = receiver()
    pf.reset()
    return msg, bool(torch.isfinite(out.a1q[:, :1].float()).all())


def test_ll_refuses_to_launch_while_a_receive_is_pending(world2):
    for msg, finite in world2.run(_ll_launch_with_pending_receive):
        assert msg.startswith("LowLatencyLimitError") and "has not run" in msg, msg
        assert finite


def _fake_detects_buffer_reuse():
    ensure_fake_deep_ep("v1")
    import deep_ep

    buf = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=4)
    x = torch.randn(4, 2048).to(torch.bfloat16)
    ids = torch.tensor([[0, 5]] * 4, dtype=torch.int64)
    first = buf.low_latency_dispatch(x, ids, 4, E, use_fp8=False, return_recv_hook=True)
    second = buf.low_latency_dispatch(x, ids, 4, E, use_fp8=False, return_recv_hook=True)
    try:
        first[4]()
        msg = "no error"
    except FakeDeepEPError as exc:
        msg = str(exc)
    second[4]()
    ok = bool(torch.isfinite(second[0][0, : int(second[1][0])].float()).all())
    return msg, ok


def test_fake_reports_a_receive_after_its_buffer_was_cleaned(world2):
    for msg, ok in world2.run(_fake_detects_buffer_reuse):
        assert "ran after launch #" in msg and "two low-latency buffers" in msg, msg
        assert ok


# ---- error paths --------------------------------------------------------------------------


def _errors(kind: str):
    pf = _backend(kind)
    x, weights, ids, _, _ = _inputs(8)
    out = {}

    def expect(name, fn):
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
            out[name] = f"{type(exc).__name__}: {exc}"

    expect("finalize without prepare", lambda: pf.finalize(
        torch.empty_like(x), torch.empty_like(x), weights, ids, False, TopKWeightAndReduceContiguous()))
    expect("expert_map", lambda: pf.prepare(x, weights, ids, E, torch.arange(E), False))
    expect("fp32 tokens", lambda: pf.prepare(x.float(), weights, ids, E, None, False))
    if kind == "ht":
        prep = pf.prepare(x, weights, ids, E, None, False)
        fused = torch.zeros(prep.a1q.shape[0], H, dtype=torch.float32)
        expect("fp32 combine", lambda: pf.finalize(torch.empty_like(x), fused, prep.topk_weights,
                                                   prep.topk_ids, False, TopKWeightAndReduceNoOp()))
    if kind == "ll":
        expect("too many tokens", lambda: pf.prepare(torch.cat([x, x, x]), torch.cat([weights] * 3),
                                                     torch.cat([ids] * 3), E, None, False))
        prep = pf.prepare(x, weights, ids, E, None, False)
        expect("contiguous reduce", lambda: pf.finalize(torch.empty_like(x), torch.zeros_like(prep.a1q),
                                                        weights, ids, False, TopKWeightAndReduceContiguous()))
        pf.reset()
    return out


def test_ht_error_paths(world2):
    for out in world2.run(_errors, "ht"):
        no_prepare = out["finalize without prepare"]
        assert no_prepare.startswith("MoEProtocolError") and "with no prepare before it" in no_prepare
        assert out["expert_map"].startswith("ValueError") and "expert_map" in out["expert_map"]
        assert out["fp32 tokens"].startswith("DeepEPDtypeError")
        assert out["fp32 combine"].startswith("DeepEPDtypeError") and "only takes bf16" in out["fp32 combine"]


def test_ll_error_paths(world2):
    for out in world2.run(_errors, "ll"):
        too_many, reduce = out["too many tokens"], out["contiguous reduce"]
        assert too_many.startswith("ValueError") and "max_tokens_per_rank" in too_many
        assert reduce.startswith("ValueError") and "Delegate or NoOp" in reduce
        assert out["fp32 tokens"].startswith("DeepEPDtypeError")


def _two_layers(kind: str):
    layers = [MoEKernel(_backend(kind), SwiGLUExperts()) for _ in range(2)]
    assert layers[0].prepare_finalize.buffer is layers[1].prepare_finalize.buffer  # one shared buffer
    x, weights, ids, w1, w2 = _inputs(16, seed=3)

    def model(s=slice(None)):
        h = x[s]
        for k in layers:
            h = k(h, w1, w2, weights[s], ids[s], global_num_experts=E)
        return h

    serial = model()
    dbo = torch.cat(run_ubatches([lambda: model(slice(0, 9)), lambda: model(slice(9, 16))], device="cpu"))
    return torch.equal(serial, dbo), bool(torch.isfinite(serial.float()).all())


@pytest.mark.parametrize("kind", ["ht", "ll"])
def test_layers_sharing_one_buffer(world2, kind):
    # two layers' backends on one DeepEP buffer: the low-latency limits are per buffer
    assert world2.run(_two_layers, kind) == [(True, True)] * 2
