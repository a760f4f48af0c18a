"""Timing for the benchmarks: :func:`median_ms` (one rank, one callable), :func:`measure` (the
overlap benchmark's per-step GPU times over the group, CPU launch time, peak memory) and a
progress bar.

:func:`measure` runs warm-up steps, then ``steps`` timed steps back to back. On CUDA each step
sits between two CUDA events on the current stream, so its time is what the GPU took from the
moment the step could start; on the CPU (gloo) it is the wall time of the call. Every rank
measures; the step times are reduced with MAX over the group, step by step (a step is as slow
as its slowest rank), and the median is reported.

CPU launch time is ``time.perf_counter`` around the call, without a sync. A step that is
GPU-bound returns long before its GPU work finishes; one whose launch time nears its GPU time
is either CPU-bound (Python cannot queue kernels as fast as the GPU runs them) or waits for
the GPU from the host (DeepEP normal-mode dispatch waits for the receive counts; ``.item()``,
``nonzero``, a pageable host-to-device copy). To tell the two apart the step is run once more
behind a GPU sleep longer than its launch time: a step that returns before the sleep ends
never waited for the GPU, and its launch time then is the pure CPU cost. A step that waited is
run once more under torch's sync debug mode (:mod:`dbo.bench.syncs`), and its notes name the
calls that synchronized.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dbo.bench.syncs import format_sites, host_syncs
from dbo.peers.collectives import all_reduce_max
from dbo.ubatch.streams import gpu_sleep  # re-exported: the benchmarks' GPU hold

__all__ = ["Timing", "median_ms", "measure", "Progress", "gpu_sleep"]


@dataclass
class Timing:
    """One configuration's numbers (milliseconds; bytes). ``step_ms``: per-step MAX over ranks."""

    step_ms: list[float]
    median_ms: float
    p10_ms: float
    p90_ms: float
    cpu_launch_ms: float                 #: median launch time, MAX over ranks
    cpu_launch_held_ms: float | None     #: launch time behind a GPU sleep (CUDA only)
    held_sleep_ms: float | None          #: how long that sleep ran on the GPU
    host_sync: bool | None               #: the step waited for the GPU from the host
    cpu_bound: bool                      #: pure launch time > 80% of the GPU time
    launch_ratio: float                  #: cpu_launch_ms / median_ms
    peak_bytes: int | None = None        #: torch.cuda.max_memory_allocated during one step
    peak_extra_bytes: int | None = None  #: that peak minus what was allocated before the step
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    _sync(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def median_ms(fn: Callable[[], Any], *, steps: int, warmup: int = 1,
              device: torch.device | str = "cpu") -> float:
    """Median milliseconds of one call of ``fn`` on this rank (no collective of its own).

    ``warmup`` untimed calls, then ``steps`` timed ones: on CUDA each between two CUDA events on
    the current stream (the GPU's time, read after one sync at the end), elsewhere the wall time
    of the call.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"median_ms needs steps >= 1 and warmup >= 0, got steps={steps}, "
                         f"warmup={warmup}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    _sync(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    _sync(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure(step: Callable[[], Any], *, warmup: int, steps: int, device: torch.device,
            memory: bool = True, hold_check: bool = True) -> Timing:
    """Time ``step`` (a zero-argument callable; every rank calls this collectively)."""
    for _ in range(warmup):
        step()
    _barrier(device)
    cuda = device.type == "cuda"
    launch: list[float] = []
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for i in range(steps):
            starts[i].record()
            t0 = time.perf_counter()
            step()
            launch.append((time.perf_counter() - t0) * 1e3)
            ends[i].record()
        _sync(device)
        local = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        local = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            dt = (time.perf_counter() - t0) * 1e3
            local.append(dt)
            launch.append(dt)
    per_step = all_reduce_max(local)
    med = statistics.median(per_step)
    launch_med = all_reduce_max([statistics.median(launch)])[0]
    held = sleep_ms = None
    host_sync = None
    notes: list[str] = []
    if cuda and hold_check:
        _barrier(device)
        hold = max(10.0, 2.0 * launch_med)
        s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_ev.record()
        gpu_sleep(hold)
        e_ev.record()
        t0 = time.perf_counter()
        step()
        held_local = (time.perf_counter() - t0) * 1e3
        _sync(device)
        sleep_local = s_ev.elapsed_time(e_ev)
        held, sleep_ms = all_reduce_max([held_local, sleep_local])
        host_sync = held >= 0.9 * sleep_ms
    # On the CPU stand-in a step's launch is its run: nothing to tell apart.
    if host_sync is False:
        cpu_bound = held > 0.8 * med
    else:
        cpu_bound = cuda and host_sync is None and launch_med > 0.8 * med
    if host_sync:
        notes.append("the step waits for the GPU from the host: its launch time includes those waits")
        with host_syncs() as sites:  # where: one more step under torch's sync debug mode
            step()
        _sync(device)
        notes.append("host syncs in one step: " + format_sites(sites).replace("\n", "; "))
    peak = extra = None
    if cuda and memory:
        _barrier(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        peak_local = torch.cuda.max_memory_allocated(device)
        peak, extra = (int(v) for v in all_reduce_max([float(peak_local), float(peak_local - base)]))
    _barrier(device)
    return Timing(step_ms=per_step, median_ms=med, p10_ms=_percentile(per_step, 0.1),
                  p90_ms=_percentile(per_step, 0.9), cpu_launch_ms=launch_med,
                  cpu_launch_held_ms=held, held_sleep_ms=sleep_ms, host_sync=host_sync,
                  cpu_bound=cpu_bound, launch_ratio=launch_med / med if med > 0 else float("nan"),
                  peak_bytes=peak, peak_extra_bytes=extra, notes=notes)


class Progress:
    """A progress bar on rank 0: tqdm when importable, else one stderr line per update."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.enabled = enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="cfg",
                                 mininterval=2.0)

    def update(self, desc: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(desc[:60])
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {desc}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
