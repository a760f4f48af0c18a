"""SM partitioning with CUDA green contexts on a GPU (skipped elsewhere).

Run: python3 -m pytest -q tests/gpu/test_partition_gpu.py -rA
"""

from __future__ import annotations

import pytest
import torch

from dbo import overlapped_forward, run_ubatches
from dbo.split import SplitConfig
from dbo.ubatch.context import dbo_yield
from dbo.ubatch.sm import PARTITIONS, compute_on_sms, green_contexts_supported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not green_contexts_supported(),
                                                  reason="needs CUDA green contexts")]


def _gemm_ms(a, b, reps=20):
    for _ in range(3):
        a @ b
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def test_compute_is_confined_to_the_partition():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    full = _gemm_ms(a, b)
    with compute_on_sms(16):
        small = _gemm_ms(a, b)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GEMM 8192^3 bf16: all {sms} SMs {full:.3f} ms, 16 SMs {small:.3f} ms")
    assert small > 3 * full  # 16 of 132 SMs: several times slower if really confined


def test_streams_restored_and_results_equal():
    caller = torch.cuda.current_stream()
    x = torch.randn(4096, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    with compute_on_sms(64) as green:
        assert torch.cuda.current_stream() == green
        y = x @ w
    assert torch.cuda.current_stream() == caller
    torch.testing.assert_close(y, x @ w)
    with pytest.raises(KeyError), compute_on_sms(64):
        raise KeyError("inside")
    assert torch.cuda.current_stream() == caller


def test_dbo_with_compute_sms_equals_serial():
    w = torch.randn(1024, 1024, device="cuda") / 32
    x = torch.randn(8192, 1024, device="cuda")

    def fn(h):
        for _ in range(4):
            h = torch.tanh(h @ w)
            dbo_yield()
        return h

    serial = fn(x)
    for sms in (66, 100, 116):
        out = overlapped_forward(fn, x, config=SplitConfig(prefill_token_threshold=1), agree=False,
                                 compute_sms=sms)
        torch.testing.assert_close(out, serial)
    assert len(PARTITIONS) >= 3


def test_run_ubatches_inside_a_partition():
    x = torch.randn(2, 4096, 512, device="cuda")
    with compute_on_sms(32):
        outs = run_ubatches([lambda: torch.relu(x[0]), lambda: torch.relu(x[1])])
    torch.testing.assert_close(torch.stack(outs), torch.relu(x))


def test_run_ubatches_compute_sms_option():
    x = torch.randn(2, 4096, 512, device="cuda")
    caller = torch.cuda.current_stream()
    seen = []

    def body(i):
        def run():
            seen.append(torch.cuda.current_stream())
            return torch.relu(x[i])
        return run

    outs = run_ubatches([body(0), body(1)], compute_sms=48)
    torch.testing.assert_close(torch.stack(outs), torch.relu(x))
    assert torch.cuda.current_stream() == caller
    assert all(s != caller for s in seen)  # the ubatches computed on the green context's stream


def test_a_run_on_a_partition_captures_and_replays():
    """A run whose compute is on a green context, captured in a CUDA graph, replays like eager."""
    torch.manual_seed(0)
    x = torch.randn(2, 2048, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 23

    def ubatches():
        def body(i):
            def run():
                h = torch.tanh(x[i] @ w)
                dbo_yield()
                return torch.tanh(h @ w)
            return run
        return [body(0), body(1)]

    side = torch.cuda.Stream()  # warm up off the default stream, as graph capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_ubatches(ubatches(), device="cuda", compute_sms=64)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run_ubatches(ubatches(), device="cuda", compute_sms=64)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = [torch.tanh(torch.tanh(x[i] @ w) @ w) for i in range(2)]
    torch.testing.assert_close(torch.stack(static), torch.stack(want))
