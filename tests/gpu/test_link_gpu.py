"""The simulated link on a GPU: the arrivals are held back on the GPU's clock (a transfer takes at
least the modelled time, measured with CUDA events), the host is not (it queues the step in far
less), and the results are the backend's bits, plain and as overlapped ubatches. One GPU: the
single-process backend under a link whose latency is the whole model. Run on the GPU host:
``pytest tests/gpu/test_link_gpu.py``."""

from __future__ import annotations

import time

import pytest
import torch

from dbo.backends.local import LocalPrepareAndFinalize
from dbo.backends.simulated_link import SimulatedLink, SimulatedLinkPrepareAndFinalize, link_wait
from dbo.backends.simulated_link import wall_wait as _wall_wait
from dbo.experts import SwiGLUExperts, make_expert_weights
from dbo.moe import MoEKernel, topk_route
from dbo.ubatch.context import run_ubatches
from dbo.ubatch.streams import gpu_sleep

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LATENCY_US = 3_000.0


def _step(kernel: MoEKernel, x, w1, w2, weights, ids, dbo: bool) -> torch.Tensor:
    def call(lo, hi):
        return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=8)

    if not dbo:
        return call(0, x.shape[0])
    cut = x.shape[0] // 2
    return torch.cat(run_ubatches([lambda: call(0, cut), lambda: call(cut, x.shape[0])]))


@pytest.mark.parametrize("dbo", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_link_holds_arrivals_on_the_gpu_not_the_host(dbo, dtype):
    torch.manual_seed(0)
    w1, w2 = make_expert_weights(8, 256, 128, dtype=dtype, device="cuda", seed=3)
    x = torch.randn(512, 256, device="cuda", dtype=dtype)
    weights, ids = topk_route(x @ torch.randn(256, 8, device="cuda", dtype=dtype), 2)
    want = _step(MoEKernel(LocalPrepareAndFinalize(), SwiGLUExperts()), x, w1, w2, weights, ids, dbo)
    pf = SimulatedLinkPrepareAndFinalize(LocalPrepareAndFinalize(), SimulatedLink(50, LATENCY_US), "local")
    kernel = MoEKernel(pf, SwiGLUExperts())
    _step(kernel, x, w1, w2, weights, ids, dbo)  # warm-up: compiles, calibrates the link stream
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    got = _step(kernel, x, w1, w2, weights, ids, dbo)
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end)
    assert torch.equal(got, want)
    # a dispatch then its combine, each held LATENCY_US past its send (both ubatches' overlap)
    assert gpu_ms >= 2 * LATENCY_US / 1e3 * 0.98, gpu_ms
    assert host_ms < LATENCY_US / 1e3, f"the host waited: {host_ms:.2f} ms"


def _busy_gemms(stream: torch.cuda.Stream, n: int) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        for _ in range(n):
            a @ a


@pytest.mark.skipif(not _wall_wait.AVAILABLE, reason="needs Triton")
def test_wall_wait_keeps_its_length_beside_gemms():
    # the link's wait reads the global timer: it lasts what it was asked for on an idle GPU and
    # beside GEMMs that load every SM (where a cycle-counted sleep runs long as the clock drops)
    ms = 20.0
    side = torch.cuda.Stream()

    def timed(wait) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wait()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def wall() -> None:
        link_wait(ms * 1e3)

    def cycles() -> None:
        gpu_sleep(ms)

    timed(wall), timed(cycles)  # compile, calibrate
    idle = timed(wall)
    _busy_gemms(side, 60)  # ~80 ms of GEMMs queued on another stream
    busy = timed(wall)
    _busy_gemms(side, 60)
    busy_cycles = timed(cycles)
    torch.cuda.synchronize()
    print(f"wall wait {ms} ms: idle {idle:.2f}, beside GEMMs {busy:.2f}; cycle sleep beside GEMMs "
          f"{busy_cycles:.2f}")
    assert ms <= idle < ms * 1.02, idle
    assert ms <= busy < ms * 1.02, busy
