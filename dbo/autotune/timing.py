"""What the autotune reads: a timed loop's milliseconds and a call's transient device memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["sync", "time_ms", "transient_bytes", "device_of", "MEMORY_MARGIN"]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(step: Callable[[], Any], warmup: int, steps: int, device: torch.device,
             clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds per call of ``step`` over ``steps`` calls after ``warmup``, read from
    ``clock`` (seconds) with the device synchronized around the loop."""
    for _ in range(warmup):
        step()
    sync(device)
    t0 = clock()
    for _ in range(steps):
        step()
    sync(device)
    return (clock() - t0) * 1e3 / steps


#: the headroom over the measured transient peak that ``min_free_bytes`` asks for
MEMORY_MARGIN = 0.1


def transient_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """The device memory one call of ``step`` took above what was allocated at its start (its
    peak; CUDA only, else 0)."""
    if device.type != "cuda":
        return 0
    sync(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - int(start))


def device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device of the first tensor among ``tensors`` (the CPU if none)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
