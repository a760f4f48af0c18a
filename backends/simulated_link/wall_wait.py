"""A GPU wait timed on the GPU's global timer (nanoseconds), not on SM clock cycles.

``torch.cuda._sleep`` spins a number of SM cycles. Its length in time follows the SM clock,
which drops when the GPU is loaded (power cap, heat): a wait calibrated on an idle GPU ran 8-20%
long beside a DBO step's GEMMs. :func:`wait_wall_ns` queues one program of one warp that reads
the ``%globaltimer`` register until the given nanoseconds have passed since it started, so its
length is the same however busy the SMs are. Needs Triton; :data:`AVAILABLE` says whether it is
there (the caller falls back to the cycle count).
"""

from __future__ import annotations

import os

__all__ = ["AVAILABLE", "MAX_NS", "wait_wall_ns"]

#: the longest wait one launch takes (an int32 argument: one specialization for every length)
MAX_NS = 2**31 - 16

try:
    import triton
    from triton.language.extra.cuda import globaltimer

    AVAILABLE = os.environ.get("TRITON_INTERPRET", "0") != "1"
except ImportError:  # pragma: no cover - the CPU install has no Triton
    AVAILABLE = False

if AVAILABLE:
    @triton.jit
    def _wait_wall_kernel(ns):
        t0 = globaltimer()
        t = t0
        while t - t0 < ns:
            t = globaltimer()


def wait_wall_ns(ns: int) -> None:
    """Queue a wait of ``ns`` nanoseconds on the current CUDA stream (rounded up to 16 ns; a wait
    past :data:`MAX_NS` is queued as several launches). Costs the host one kernel launch, the GPU
    one warp for that long."""
    if not AVAILABLE:
        raise RuntimeError("wait_wall_ns needs Triton, not importable here or run by its "
                           "interpreter")
    from dbo.moe.kernels.triton_launch import launch

    # rounded up to a multiple of 16: Triton specializes an integer on its divisibility by 16,
    # so every length runs the one compiled kernel
    left = -(-max(int(ns), 1) // 16) * 16
    while left > 0:
        step = min(left, MAX_NS)
        launch(_wait_wall_kernel, (1,), (step,), {"num_warps": 1})
        left -= step
