"""The stream protocol on a real GPU: the event waits of the switches are what keeps numbers right.

Ubatch A computes on the compute stream, switches to the comm stream, where its work is held
back by ``torch.cuda._sleep`` (about 100 ms: a slow all-to-all), then writes its result; it
switches back to the compute stream, which reads the result. Ubatch B keeps the compute stream
busy with its own work meanwhile. With the switch that waits, A reads its own result; with the
wait removed (the plain switch), the compute stream reads the buffer before the comm stream has
written it, and the numbers come out wrong: proof that the test sees a missing wait. The same
for the other direction (compute is slow, comm reads) and for the yield-and-switch functions.
A run captured in a CUDA graph must replay with the numbers of the eager run.

Run on a GPU host: ``pytest tests/gpu/test_streams_gpu.py -m gpu`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from dbo import (
    dbo_current_context,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_deferred,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SLEEP_MS = 100.0  # how long the slow stream is held back; the other stream's reads take us
NUMEL = 1 << 20
SENTINEL = -1.0  # what the handed-over buffer holds before the producer writes it


@pytest.fixture(scope="module")
def sleep_cycles() -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to spin about SLEEP_MS milliseconds."""
    torch.cuda._sleep(1000)  # load the kernel
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles / start.elapsed_time(end) * SLEEP_MS)


def _yield_then(switch):
    def missing_wait():
        dbo_yield()
        switch()

    return missing_wait


def _deferred(wait: bool):
    def switch():
        w = dbo_switch_to_compute_deferred()
        torch.empty(16, device="cuda").fill_(1.0)  # queued before the wait (a shared expert)
        if wait:
            w()

    return switch


# name -> (A's switch from comm back to compute, whether it waits)
BACK_TO_COMPUTE = {
    "switch_to_compute_deferred_then_wait": (_deferred(True), True),
    "switch_to_compute_deferred_no_wait": (_deferred(False), False),
    "switch_to_compute_sync": (dbo_switch_to_compute_sync, True),
    "switch_to_compute": (dbo_switch_to_compute, False),
    "yield_and_switch_from_comm_to_compute": (dbo_yield_and_switch_from_comm_to_compute, True),
    "yield_then_switch_to_compute": (_yield_then(dbo_switch_to_compute), False),
}
# name -> (A's switch from compute to comm, whether it waits)
TO_COMM = {
    "switch_to_comm_sync": (dbo_switch_to_comm_sync, True),
    "switch_to_comm": (dbo_switch_to_comm, False),
    "yield_and_switch_from_compute_to_comm": (dbo_yield_and_switch_from_compute_to_comm, True),
    "yield_then_switch_to_comm": (_yield_then(dbo_switch_to_comm), False),
}


def _busy_ubatch(w: torch.Tensor, keep: list):
    """Ubatch B: compute-stream work only, interleaved with A by its yields."""

    def b():
        y = w @ w
        dbo_yield()
        z = torch.relu(y) + 1
        dbo_yield()
        keep.extend([y, z])
        return z.sum()

    return b


def slow_comm_then_compute(back_to_compute, sleep_cycles: int, caller: torch.cuda.Stream):
    """A: compute x, comm_sync, sleep + write ``buf = x + 1`` on comm, switch back to compute
    with ``back_to_compute``, read ``out = buf * 3`` there. Returns (out, expected, streams)."""
    keep: list = []  # tensors used across streams stay alive until the end (no reuse)
    seen: dict = {}
    with torch.cuda.stream(caller):
        inp = torch.arange(NUMEL, device="cuda", dtype=torch.float32)
        buf = torch.full((NUMEL,), SENTINEL, device="cuda")
        w = torch.randn(512, 512, device="cuda")

        def a():
            x = inp * 2
            seen["compute"] = torch.cuda.current_stream()
            dbo_switch_to_comm_sync()
            seen["comm"] = torch.cuda.current_stream()
            seen["ctx_comm"] = dbo_current_context().comm_stream
            torch.cuda._sleep(sleep_cycles)  # a slow all-to-all
            buf.copy_(x + 1)
            dbo_yield()  # B queues compute work that overlaps the comm stream's sleep
            back_to_compute()
            seen["back"] = torch.cuda.current_stream()
            out = buf * 3
            keep.extend([x, out])
            return out

        out, b_sum = run_ubatches([a, _busy_ubatch(w, keep)], device="cuda")
        seen["after"] = torch.cuda.current_stream()
    torch.cuda.synchronize()
    expected = (inp * 2 + 1) * 3
    assert torch.isfinite(b_sum)
    return out, expected, seen


def slow_compute_then_comm(to_comm, sleep_cycles: int, caller: torch.cuda.Stream):
    """A: sleep + write ``buf = inp * 2 + 1`` on compute, switch to comm with ``to_comm``,
    read ``out = buf * 3`` there, switch back (waiting). Returns (out, expected)."""
    keep: list = []
    with torch.cuda.stream(caller):
        inp = torch.arange(NUMEL, device="cuda", dtype=torch.float32)
        buf = torch.full((NUMEL,), SENTINEL, device="cuda")
        w = torch.randn(512, 512, device="cuda")

        def a():
            torch.cuda._sleep(sleep_cycles)  # slow compute
            buf.copy_(inp * 2 + 1)
            to_comm()
            out = buf * 3
            dbo_switch_to_compute_sync()
            keep.append(out)
            return out

        out, _ = run_ubatches([a, _busy_ubatch(w, keep)], device="cuda")
    torch.cuda.synchronize()
    return out, (inp * 2 + 1) * 3


@pytest.fixture(params=["default", "side"])
def caller_stream(request) -> torch.cuda.Stream:
    """The caller's current stream, which becomes the run's compute stream."""
    return torch.cuda.default_stream() if request.param == "default" else torch.cuda.Stream()


@pytest.mark.parametrize("name", list(BACK_TO_COMPUTE))
def test_comm_result_read_on_compute(name, sleep_cycles, caller_stream):
    back, waits = BACK_TO_COMPUTE[name]
    out, expected, seen = slow_comm_then_compute(back, sleep_cycles, caller_stream)
    assert seen["comm"] != seen["compute"], "comm and compute are the same stream"
    assert seen["compute"] == caller_stream and seen["back"] == caller_stream
    assert seen["comm"] == seen["ctx_comm"] and seen["after"] == caller_stream
    if waits:
        assert torch.equal(out, expected), f"{name}: wrong numbers although the switch waits"
    else:
        # The compute stream read the buffer while the comm stream was still asleep.
        stale = torch.full_like(out, SENTINEL * 3)
        assert not torch.equal(out, expected), f"{name}: right numbers without a wait?"
        assert torch.equal(out, stale), f"{name}: expected the stale buffer, got {out[:4]}"


@pytest.mark.parametrize("name", list(TO_COMM))
def test_compute_result_read_on_comm(name, sleep_cycles, caller_stream):
    to_comm, waits = TO_COMM[name]
    out, expected = slow_compute_then_comm(to_comm, sleep_cycles, caller_stream)
    if waits:
        assert torch.equal(out, expected), f"{name}: wrong numbers although the switch waits"
    else:
        stale = torch.full_like(out, SENTINEL * 3)
        assert not torch.equal(out, expected), f"{name}: right numbers without a wait?"
        assert torch.equal(out, stale), f"{name}: expected the stale buffer, got {out[:4]}"


def test_captured_run_replays_like_eager():
    torch.manual_seed(0)
    inp = torch.randn(1 << 16, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    rows = torch.randn(64, 256, device="cuda")
    keep: list = []

    def ubatches():
        def a():
            x = inp * 2
            dbo_switch_to_comm_sync()
            y = x + 1  # comm-stream work
            dbo_yield()
            dbo_switch_to_compute_sync()
            keep.extend([x, y])
            return y * 3

        def b():
            h = rows @ w
            dbo_yield_and_switch_from_compute_to_comm()
            r = torch.relu(h)  # comm-stream work
            dbo_yield_and_switch_from_comm_to_compute()
            keep.extend([h, r])
            return r.sum(dim=0)

        return [a, b]

    def reference():
        return [(inp * 2 + 1) * 3, torch.relu(rows @ w).sum(dim=0)]

    side = torch.cuda.Stream()  # warm up off the default stream, as graph capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_ubatches(ubatches(), device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run_ubatches(ubatches(), device="cuda")

    for seed in (1, 2):
        torch.manual_seed(seed)
        inp.copy_(torch.randn_like(inp))
        rows.copy_(torch.randn_like(rows))
        graph.replay()
        torch.cuda.synchronize()
        eager = run_ubatches(ubatches(), device="cuda")
        torch.cuda.synchronize()
        ref = reference()
        assert torch.equal(static_out[0], eager[0]) and torch.equal(static_out[0], ref[0])
        torch.testing.assert_close(static_out[1], eager[1])
        torch.testing.assert_close(static_out[1], ref[1])
        keep.clear()


def test_fast_current_stream_and_stream_context_match_torch():
    """``cuda_current_stream`` and ``on_cuda_stream`` (the per-call paths' cheaper forms) see and
    set what torch's ``current_stream`` and ``torch.cuda.stream`` do, nested, restored on an
    exception, and inside a graph capture (where the current stream is the capture's)."""
    from dbo.ubatch.streams import cuda_current_stream, on_cuda_stream

    dev = torch.device("cuda")
    outer, inner = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    base = torch.cuda.current_stream()
    assert cuda_current_stream() == base and cuda_current_stream(dev) == base
    assert cuda_current_stream(torch.cuda.current_device()) == base
    with on_cuda_stream(outer) as s:
        assert s is outer and torch.cuda.current_stream() == outer == cuda_current_stream(dev)
        with torch.cuda.stream(inner):
            assert cuda_current_stream() == inner
        assert torch.cuda.current_stream() == outer
        with pytest.raises(ValueError), on_cuda_stream(inner):
            assert torch.cuda.current_stream() == inner
            raise ValueError("inside")
        assert torch.cuda.current_stream() == outer
    assert torch.cuda.current_stream() == base == cuda_current_stream()
    # an event recorded on the fast form's stream orders like one recorded on torch's
    x = torch.zeros(1 << 20, device=dev)
    with on_cuda_stream(outer):
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)
        ev = torch.cuda.Event()
        ev.record(cuda_current_stream())
    cuda_current_stream().wait_event(ev)
    assert x.sum().item() == x.numel()

    side = torch.cuda.Stream()
    side.wait_stream(base)
    graph = torch.cuda.CUDAGraph()
    y = torch.zeros(8, device=dev)
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        assert cuda_current_stream() == capture
        with on_cuda_stream(inner):
            assert torch.cuda.current_stream() == inner
        assert cuda_current_stream() == capture
        y.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert y.sum().item() == 8
