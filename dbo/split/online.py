"""Plain or overlapped, decided by measuring: the choice a wrapper that nobody tuned makes.

Whether two overlapped ubatches beat one plain forward depends on the model, the batch size,
the backend and the machine (``docs/performance.md``): an untuned wrapper that always splits
above the thresholds can lose 10-25%. :class:`OnlineChoice` measures instead. For each size
bucket (the split plan's whole padded batch, rounded up to a power of two: the same on every
rank, since the plan is agreed), the first calls run each candidate in turn (the plain forward
and each expert schedule) in a block of one warm-up call and then ``trials`` timed calls. Then
the ranks agree on the timings (each candidate's median, the slowest rank's) with one small
all-reduce, and the bucket keeps the fastest candidate; an overlapped one only when it beats the
plain forward by ``margin``. Every ``recheck_calls`` calls the bucket measures again, so a choice
that stops paying (another backend, a warmer GPU) does not stay.

Every rank must make the same calls in the same order, which the split vote already demands
(the ranks run the same collectives): each call's candidate follows from the bucket's call
count alone, and the agreement happens at the same call everywhere.

Timing adds no host sync to a call: on CUDA each timed call records two events on the current
stream, read once at the decision (by then they have completed, or the read waits for the
last); on CPU the calls are synchronous and a clock is read around them.

What it does can be watched: :meth:`OnlineChoice.progress` says which bucket is measuring and
which call of how many, :meth:`OnlineChoice.table` lists the timings so far and the choices,
and each decision is one WARNING line on this module's logger (``dbo.split.online``; rank 0 of
the group at WARNING, the other ranks, which decide alike, at INFO, every rank at WARNING with
``agree=False``; a recheck that keeps its choice at INFO), so it prints under Python's default logging.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.expert_schedule import ExpertSchedule, parse_expert_schedule
from dbo.peers.collectives import all_reduce_max
from dbo.peers.groups import group_rank
from dbo.split.types import UBatchPlan

__all__ = ["OnlineChoice", "BucketChoice", "size_bucket"]

logger = logging.getLogger(__name__)

#: the candidates measured by default: the plain forward and every other expert schedule
DEFAULT_CANDIDATES = (ExpertSchedule.PLAIN, ExpertSchedule.SPLIT, ExpertSchedule.MERGED,
                      ExpertSchedule.SBO)


def size_bucket(plan: UBatchPlan) -> int:
    """The bucket of a split plan: its whole padded batch (``num_ubatches * padded_size``,
    the same on every rank of the group) rounded up to a power of two."""
    rows = plan.num_ubatches * plan.padded_size
    return 1 << max(0, rows - 1).bit_length()


class _Timer:
    """One call's time: CUDA events on the current stream, or a host clock."""

    __slots__ = ("start", "end", "t0", "t1", "clock")

    def __init__(self, device: torch.device | None, clock: Callable[[], float] | None):
        self.clock = clock
        self.start = self.end = None
        if clock is None and device is not None and device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = (clock or time.perf_counter)()

    def stop(self) -> None:
        if self.end is not None:
            self.end.record()
        else:
            self.t1 = (self.clock or time.perf_counter)()

    def ms(self) -> float:
        if self.end is not None:
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end))
        return (self.t1 - self.t0) * 1e3

    def done(self) -> bool:
        """True when :meth:`ms` can be read without waiting for the device."""
        return self.end is None or self.end.query()


@dataclass
class BucketChoice:
    """One size bucket's state: the calls it has seen, the timings of the current round of
    measurement, and the choice (None while measuring).

    Attributes:
        bucket: the bucket's whole padded batch (a power of two).
        calls: calls seen since the bucket last started measuring.
        chosen: the candidate kept, or None while measuring.
        medians_ms: each candidate's median at the last decision (the slowest rank's).
        decisions: how many times the bucket has decided.
        chosen_before: the choice a recheck under way started from (None before the first).
    """

    bucket: int
    calls: int = 0
    chosen: ExpertSchedule | None = None
    medians_ms: dict[ExpertSchedule, float] = field(default_factory=dict)
    decisions: int = 0
    chosen_before: ExpertSchedule | None = field(default=None, repr=False)
    timers: dict[ExpertSchedule, list[_Timer]] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """The last decision: each candidate's median and the choice."""
        times = ", ".join(f"{c.value} {ms:.3f} ms" for c, ms in self.medians_ms.items())
        return f"~{self.bucket} tokens: {times} -> {self.chosen.value if self.chosen else '?'}"

    def describe_measuring(self, trials: int, calls_to_decide: int) -> str:
        """The round of measurement under way: each candidate's median so far (of its timed
        calls whose timing can be read without waiting for the device) and the call count."""
        parts = []
        for c, timers in self.timers.items():
            ready = [t.ms() for t in timers if t.done()]
            median = f"{statistics.median(ready):.3f} ms" if ready else "pending"
            parts.append(f"{c.value} {median} ({len(timers)} of {trials} timed)")
        times = ", ".join(parts) if parts else "no timed call yet"
        return f"~{self.bucket} tokens: {times} -> measuring (call {self.calls} of {calls_to_decide})"


class OnlineChoice:
    """Chooses, per size bucket, between the plain forward and the overlapped schedules by
    timing the first calls (see the module docstring).

    Args:
        candidates: what to measure; must hold ``plain`` and at least one overlapped schedule
            (default plain, split, merged).
        trials: timed calls per candidate (after one warm-up call of its own); >= 1.
        margin: an overlapped candidate is kept only if its median is below the plain
            forward's by this fraction (0.02: 2%), so noise keeps the plain forward.
        recheck_calls: after this many calls on its choice a bucket measures again (None:
            never).
        group: the process group whose ranks agree on the timings (None: the default group;
            no collective without torch.distributed or in a group of one).
        agree: False decides on this rank's timings alone, with no collective (ranks may
            then choose differently: only where nothing in the forward needs them to agree).
        clock: a host clock in seconds to time calls with instead of CUDA events (tests inject
            one; default: CUDA events on CUDA, ``time.perf_counter`` elsewhere).
    """

    def __init__(self, candidates: Sequence[ExpertSchedule | str] = DEFAULT_CANDIDATES, *,
                 trials: int = 3, margin: float = 0.02, recheck_calls: int | None = 1000,
                 group: Any = None, agree: bool = True, clock: Callable[[], float] | None = None):
        cands = tuple(dict.fromkeys(parse_expert_schedule(c) for c in candidates))
        if ExpertSchedule.PLAIN not in cands or len(cands) < 2:
            raise ValueError(f"candidates must hold 'plain' and at least one overlapped schedule, "
                             f"got {[str(c) for c in candidates]!r}")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials must be an int >= 1, got {trials!r}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if recheck_calls is not None and (not isinstance(recheck_calls, int) or recheck_calls < 1):
            raise ValueError(f"recheck_calls must be an int >= 1 or None, got {recheck_calls!r}")
        self.candidates = cands
        self.trials = trials
        self.margin = margin
        self.recheck_calls = recheck_calls
        self.group = group
        self.agree = agree
        self.clock = clock
        self.buckets: dict[int, BucketChoice] = {}

    @property
    def calls_to_decide(self) -> int:
        """Calls a bucket measures before it decides."""
        return len(self.candidates) * (1 + self.trials)

    def choice(self, plan: UBatchPlan) -> ExpertSchedule | None:
        """The bucket's current choice for a split ``plan`` (None while it measures)."""
        b = self.buckets.get(size_bucket(plan))
        return None if b is None else b.chosen

    def progress(self, plan: UBatchPlan) -> str | None:
        """What the latest call of ``plan``'s bucket was, while the bucket measures (None once it
        has chosen, or before its first call): ``"measuring ~4096 tokens: call 5 of 16, split
        (warm-up)"``. Read inside the ``call`` given to :meth:`run`, it describes that call."""
        b = self.buckets.get(size_bucket(plan))
        if b is None or b.chosen is not None or b.calls == 0:
            return None
        block = 1 + self.trials
        i = b.calls - 1
        kind = "warm-up" if i % block == 0 else f"timed {i % block} of {self.trials}"
        return (f"measuring ~{b.bucket} tokens: call {b.calls} of {self.calls_to_decide}, "
                f"{self.candidates[i // block].value} ({kind})")

    def run(self, plan: UBatchPlan, call: Callable[[ExpertSchedule], Any],
            device: torch.device | None = None) -> Any:
        """Run one call of a split ``plan``: ``call(schedule)`` runs the forward plainly
        (``ExpertSchedule.PLAIN``), unsplit with ``sbo``, or split with that schedule. Returns its result.
        Collective at a bucket's decision (every rank reaches it at the same call)."""
        key = size_bucket(plan)
        b = self.buckets.setdefault(key, BucketChoice(key))
        if b.chosen is not None:
            if self.recheck_calls is None or b.calls < self.recheck_calls:
                b.calls += 1
                return call(b.chosen)
            # measure again, each candidate's block from its warm-up
            b.chosen_before, b.chosen, b.calls = b.chosen, None, 0
        return self._measure(b, call, device)

    def _measure(self, b: BucketChoice, call: Callable[[ExpertSchedule], Any],
                 device: torch.device | None) -> Any:
        i = b.calls
        b.calls += 1
        # each candidate's calls in one block: its first (the warm-up: caches, kernels' first
        # launch, the allocator, and the GPU's backlog of the previous block) is not timed, so
        # the timed calls run as that candidate runs when chosen. Interleaved, a candidate whose
        # host launches outlast its GPU time can be timed on the GPU alone, its launches hidden
        # behind the previous candidate's GPU backlog, and win where it loses
        block = 1 + self.trials
        cand = self.candidates[i // block]
        if i % block == 0:
            return call(cand)
        timer = _Timer(device, self.clock)
        out = call(cand)
        timer.stop()
        b.timers.setdefault(cand, []).append(timer)
        if b.calls == self.calls_to_decide:
            self._decide(b)
        return out

    def _decide(self, b: BucketChoice) -> None:
        local = [statistics.median(t.ms() for t in b.timers[c]) for c in self.candidates]
        agreed = all_reduce_max(local, self.group, phase="dbo online choice") if self.agree else local
        medians = dict(zip(self.candidates, agreed, strict=True))
        plain = medians[ExpertSchedule.PLAIN]
        best = min((c for c in self.candidates if c is not ExpertSchedule.PLAIN), key=medians.get)
        previous = b.chosen_before
        b.chosen = best if medians[best] < plain * (1 - self.margin) else ExpertSchedule.PLAIN
        b.medians_ms, b.calls, b.timers = medians, 0, {}
        b.decisions += 1
        # one line a user sees under default logging: the first choice and a changed one, from
        # rank 0 when the ranks agree (the others would only repeat it), else from every rank
        loud = (previous is None or previous is not b.chosen) and (
            not self.agree or group_rank(self.group) == 0)
        logger.log(logging.WARNING if loud else logging.INFO, "dbo chose %s", b.describe())

    def table(self) -> str:
        """One line per bucket: a decided bucket's medians and choice, a measuring bucket's
        medians so far and its call count (reads no timing that would wait for the device)."""
        lines = []
        for _, b in sorted(self.buckets.items()):
            if b.chosen is None:
                lines.append(b.describe_measuring(self.trials, self.calls_to_decide))
            else:
                lines.append(b.describe())
        return "\n".join(lines)
