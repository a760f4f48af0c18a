"""Schedule trace: what each ubatch did and when.

Pass a :class:`Trace` to ``run_ubatches(..., trace=t)``. The driver records when each ubatch
runs, its stream switches, hook registration and execution, event records and waits, and the
user-named regions opened with :func:`dbo.dbo_region`. Export as Chrome trace JSON (opens in
Perfetto: one track per ubatch for its running slices, one for its regions) or as a compact
text timeline for test failure messages. On CUDA, running slices and regions are also emitted
as NVTX ranges and ``torch.profiler`` ranges named ``dbo.ub<i>...``, so a GPU profile shows
which ubatch each kernel belongs to.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dbo.files import write_whole

__all__ = ["Trace", "TraceEvent", "EVENT_KINDS"]

#: kinds of :class:`TraceEvent`, in the order a reader meets them
EVENT_KINDS = (
    "run_begin",      # detail: number of ubatches
    "resume",         # the driver switched into the ubatch
    "suspend",        # the ubatch yielded back to the driver
    "finish",         # the ubatch's callable returned
    "fail",           # the ubatch raised; detail: exception type
    "unwind",         # GreenletExit was thrown into the ubatch, which runs its finally blocks
    "unwound",        # ... and has ended
    "stream",         # the ubatch's current stream changed; detail: "compute" / "comm"
    "record",         # an event was recorded; detail: event name
    "wait",           # a stream waits on an event; detail: event name
    "hook_register",  # detail: index of the slot's ubatch
    "hook_begin",     # detail: index of the registrant
    "hook_end",
    "region_begin",   # detail: region name
    "region_end",
    "run_end",
)


@dataclass(frozen=True)
class TraceEvent:
    seq: int
    t_ns: int
    kind: str
    ubatch: int
    detail: str

    def line(self) -> str:
        return f"{self.seq:4d} ub{self.ubatch} {self.kind}" + (f" {self.detail}" if self.detail else "")


class _Ranges:
    """NVTX and profiler ranges for CUDA runs; no-ops when neither is wanted."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self.open: dict[Any, tuple[int | None, Any]] = {}

    def begin(self, key: Any, name: str) -> None:
        if not self.enabled:
            return
        nvtx_id = torch.cuda.nvtx.range_start(name)
        rf = None
        if torch.autograd.profiler._is_profiler_enabled:
            rf = torch.ops.profiler._record_function_enter_new(name, None)
        self.open[key] = (nvtx_id, rf)

    def end(self, key: Any) -> None:
        entry = self.open.pop(key, None)
        if entry is None:
            return
        nvtx_id, rf = entry
        if rf is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(rf)
        if nvtx_id is not None:
            torch.cuda.nvtx.range_end(nvtx_id)

    def end_all(self) -> None:
        for key in list(self.open):
            self.end(key)


class Trace:
    """Recorder of one or more runs. Not thread-safe: one thread records into it at a time.

    ``ranges=True`` (the default) also emits NVTX / profiler ranges when the run is on CUDA.
    ``meta``: run-level facts written by whoever starts the runs (:func:`dbo.overlapped_forward`
    sets ``expert_schedule``, the schedule of its latest run); exported as the Chrome trace's
    ``otherData``.
    """

    def __init__(self, *, ranges: bool = True):
        self.events: list[TraceEvent] = []
        self.meta: dict[str, str] = {}
        self._ranges_wanted = ranges
        self._ranges = _Ranges(False)
        self._open_regions: dict[int, list[str]] = {}
        self._t0 = time.perf_counter_ns()

    # ---- recording (called by the context) ----------------------------------------------

    def record(self, kind: str, ubatch: int, detail: str = "") -> None:
        self.events.append(TraceEvent(len(self.events), time.perf_counter_ns() - self._t0,
                                      kind, ubatch, detail))
        if kind == "resume":
            self._ranges.begin(("run", ubatch), f"dbo.ub{ubatch}")
        elif kind == "unwind":
            self._ranges.begin(("run", ubatch), f"dbo.ub{ubatch}.unwind")
        elif kind in ("suspend", "finish", "fail", "unwound"):
            self._ranges.end(("run", ubatch))

    def begin_run(self, num_ubatches: int, cuda: bool) -> None:
        self._ranges = _Ranges(self._ranges_wanted and cuda)
        self.record("run_begin", 0, str(num_ubatches))

    def end_run(self) -> None:
        """Close whatever is still open (regions of a failed ubatch), then mark the end."""
        for ub, names in self._open_regions.items():
            while names:
                self.region_end(ub, names[-1])
        self._ranges.end_all()
        self.record("run_end", 0)

    def region_begin(self, ubatch: int, name: str) -> None:
        self._open_regions.setdefault(ubatch, []).append(name)
        self.record("region_begin", ubatch, name)
        self._ranges.begin(("region", ubatch, len(self._open_regions[ubatch])), f"dbo.ub{ubatch}.{name}")

    def region_end(self, ubatch: int, name: str) -> None:
        names = self._open_regions.get(ubatch)
        if not names or names[-1] != name:
            return  # already closed by end_run after a failure
        self._ranges.end(("region", ubatch, len(names)))
        names.pop()
        self.record("region_end", ubatch, name)

    # ---- export -------------------------------------------------------------------------

    def text(self, *, kinds: tuple[str, ...] | None = None) -> str:
        """One line per event, ``seq ub<i> kind detail``; times left out so it is stable."""
        return "\n".join(e.line() for e in self.events if kinds is None or e.kind in kinds)

    def to_chrome(self) -> dict:
        """Chrome trace JSON (``{"traceEvents": [...]}``, plus ``"otherData"`` with
        :attr:`meta` when it has entries), microsecond timestamps.

        Tracks (``tid``): ``2*i`` holds ubatch i's running slices, with instant events for
        stream switches, hooks and event record/wait; ``2*i+1`` holds its named regions.
        """
        out: list[dict] = []
        names: dict[int, str] = {}

        def us(t_ns: int) -> float:
            return t_ns / 1000.0

        for e in self.events:
            run_tid, region_tid = 2 * e.ubatch, 2 * e.ubatch + 1
            names.setdefault(run_tid, f"ubatch {e.ubatch}")
            base = {"pid": 0, "ts": us(e.t_ns)}
            if e.kind in ("resume", "unwind"):
                what = "running" if e.kind == "resume" else "unwinding"
                out.append({**base, "tid": run_tid, "ph": "B", "name": f"ub{e.ubatch} {what}",
                            "cat": "run"})
            elif e.kind in ("suspend", "finish", "fail", "unwound"):
                if e.kind in ("finish", "fail"):
                    out.append({**base, "tid": run_tid, "ph": "i", "s": "t", "name": e.kind,
                                "cat": "run", "args": {"detail": e.detail}})
                out.append({**base, "tid": run_tid, "ph": "E", "cat": "run"})
            elif e.kind == "region_begin":
                names.setdefault(region_tid, f"ubatch {e.ubatch} regions")
                out.append({**base, "tid": region_tid, "ph": "B", "name": e.detail, "cat": "region"})
            elif e.kind == "region_end":
                out.append({**base, "tid": region_tid, "ph": "E", "cat": "region"})
            else:
                out.append({**base, "tid": run_tid, "ph": "i", "s": "t", "name": e.kind,
                            "cat": "sched", "args": {"detail": e.detail}})
        meta = [{"pid": 0, "tid": tid, "ph": "M", "name": "thread_name", "args": {"name": n}}
                for tid, n in sorted(names.items())]
        meta.append({"pid": 0, "ph": "M", "name": "process_name", "args": {"name": "dbo"}})
        doc = {"traceEvents": meta + out, "displayTimeUnit": "ns"}
        if self.meta:
            doc["otherData"] = dict(self.meta)
        return doc

    def write_chrome(self, path: str | Path) -> Path:
        """Write :meth:`to_chrome` to ``path`` (open it at https://ui.perfetto.dev)."""
        return write_whole(path, json.dumps(self.to_chrome()))
