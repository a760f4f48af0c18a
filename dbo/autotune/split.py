"""Measure where dual-batch overlap starts to pay on this machine and set the thresholds.

Whether two overlapped ubatches beat one plain forward depends on the model, the batch size
and the machine: DBO hides communication behind compute, but each ubatch runs every local
expert, so the expert weights are read once per ubatch, and small batches are bound by that
read. On two H200s joined by NVLink, DeepEP low-latency decode lost at every batch size
measured (docs/performance.md). :func:`autotune_split_config` times the plain and the
overlapped forward at a few token counts and returns a :class:`~dbo.split.SplitConfig` whose
threshold splits only where DBO was faster, so that the wrapper picks the faster mode.

It measures every expert schedule (:mod:`dbo.expert_schedule`): ``plain`` (the forward
unsplit), ``split`` (each ubatch runs its own experts), ``merged`` (the ubatches' experts run
as one call: one read of the weights) and ``sbo`` (unsplit, the combine leaving per expert
group), and picks the schedule and threshold with the lowest
cost over the measured sizes (:func:`pick_schedule`).

Every rank of the expert-parallel group must call it with the same arguments (the forwards
issue collectives). The timings are reduced to the slowest rank's, so every rank gets the same
answer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.autotune.timing import MEMORY_MARGIN, device_of, time_ms, transient_bytes
from dbo.expert_schedule import ExpertSchedule, parse_expert_schedule
from dbo.overlap import overlapped_forward
from dbo.peers.collectives import all_reduce_max, group_size
from dbo.peers.watchdog import collective_timeout
from dbo.run_options import RunOptions
from dbo.split import NEVER_SPLIT, SplitConfig, no_split_plan, plan_ubatches
from dbo.ubatch.sm import check_sm_carveout

__all__ = [
    "NEVER_SPLIT",
    "AutotuneRow",
    "AutotuneResult",
    "pick_threshold",
    "pick_schedule",
    "autotune_split_config",
]

logger = logging.getLogger(__name__)

#: the schedules that split, in the order their columns are measured (split is the default)
SPLIT_SCHEDULES = (ExpertSchedule.SPLIT, ExpertSchedule.MERGED, ExpertSchedule.SBO_DBO)


@dataclass(frozen=True)
class AutotuneRow:
    """One token count: the plain and the overlapped forward, ms per call (slowest rank).

    ``dbo_ms``: the ``split`` schedule; ``merged_ms``: the ``merged`` one. Either is None
    where the batch could not be split (fewer tokens than ubatches) or that schedule was not
    measured.
    """

    tokens: int
    serial_ms: float
    dbo_ms: float | None
    merged_ms: float | None = None
    #: the unsplit forward under the ``sbo`` schedule (None: not measured)
    sbo_ms: float | None = None
    #: DBO with the ``sbo+dbo`` schedule (None: not measured)
    sbo_dbo_ms: float | None = None

    @property
    def ratio(self) -> float | None:
        """DBO (split schedule) / serial (< 1: DBO is faster)."""
        return None if self.dbo_ms is None else self.dbo_ms / self.serial_ms

    @property
    def merged_ratio(self) -> float | None:
        """DBO with the merged schedule / serial."""
        return None if self.merged_ms is None else self.merged_ms / self.serial_ms

    def ms(self, schedule: ExpertSchedule | str) -> float | None:
        """The time of ``schedule`` at this size (None: not measured)."""
        s = parse_expert_schedule(schedule)
        return {ExpertSchedule.PLAIN: self.serial_ms, ExpertSchedule.SPLIT: self.dbo_ms,
                ExpertSchedule.MERGED: self.merged_ms, ExpertSchedule.SBO: self.sbo_ms,
                ExpertSchedule.SBO_DBO: self.sbo_dbo_ms}[s]

    @property
    def best(self) -> ExpertSchedule:
        """The fastest schedule measured at this size (ties go to the simpler one)."""
        timed = [(ms, k, s) for k, s in enumerate(ExpertSchedule) if (ms := self.ms(s)) is not None]
        return min(timed)[2]


@dataclass(frozen=True)
class AutotuneResult:
    """What :func:`autotune_split_config` measured and chose.

    Attributes:
        config: the input config with the tuned threshold (decode or prefill).
        decode_only: which threshold was tuned.
        threshold: the smallest token count from which DBO (with ``schedule``) won at every
            measured size, or :data:`NEVER_SPLIT` if it won at none (or not at the largest).
        rows: the measurements, by increasing token count.
        margin: how much faster DBO had to be to count as winning.
        schedule: the chosen :class:`~dbo.expert_schedule.ExpertSchedule`: ``split``,
            ``merged``, ``sbo+dbo`` or ``sbo`` (also in ``config.expert_schedule``), or ``plain``
            when none won
            (then ``threshold`` is :data:`NEVER_SPLIT` and ``config.expert_schedule`` is the
            input's).
    """

    config: SplitConfig
    decode_only: bool
    threshold: int
    rows: tuple[AutotuneRow, ...]
    margin: float
    schedule: ExpertSchedule = ExpertSchedule.SPLIT
    #: the SM carve-out of the overlapped runs in ``rows`` (chosen among ``sm_carveouts`` when
    #: the call gave several); give it to the wrapper (``DBOWrapper(..., sm_carveout=...)``)
    sm_carveout: int | None = None
    #: the carve-outs measured (one entry when the call gave ``sm_carveout`` alone)
    carveouts_tried: tuple[int | None, ...] = (None,)
    #: the plain call's transient device memory per row (token count), plus the margin of
    #: ``min_free_bytes``, the largest over the counts and ranks; 0 where not measured (the CPU)
    plain_bytes_per_row: int = 0

    def table(self) -> str:
        """The measurements as a small text table."""
        kind = "decode" if self.decode_only else "prefill"

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        both = any(r.sbo_dbo_ms is not None for r in self.rows)
        lines = [f"{'tokens':>8} {'serial ms':>10} {'dbo ms':>10} {'dbo/serial':>11} "
                 f"{'merged ms':>10} {'merged/ser':>11} {'sbo ms':>10} "
                 + (f"{'sbo+dbo ms':>11} " if both else "") + f"{'best':>7}"]
        for r in self.rows:
            lines.append(f"{r.tokens:>8} {r.serial_ms:>10.3f} {f(r.dbo_ms):>10} {f(r.ratio):>11} "
                         f"{f(r.merged_ms):>10} {f(r.merged_ratio):>11} {f(r.sbo_ms):>10} "
                         + (f"{f(r.sbo_dbo_ms):>11} " if both else "") + f"{r.best.value:>7}")
        thr = "never" if self.threshold >= NEVER_SPLIT else f">= {self.threshold} tokens"
        how = "" if self.threshold >= NEVER_SPLIT else f", {self.schedule.value} experts"
        lines.append(f"{kind} threshold: split {thr}{how} (DBO must win by {100 * self.margin:.0f}%)")
        if len(self.carveouts_tried) > 1:
            tried = ", ".join("none" if k is None else str(k) for k in self.carveouts_tried)
            lines.append(f"SM carve-out: {self.sm_carveout} (of {tried}; the rows above are its runs)")
        return "\n".join(lines)


def pick_threshold(rows: Sequence[AutotuneRow], margin: float = 0.02) -> int:
    """The smallest token count ``t`` such that DBO beat serial by ``margin`` at ``t`` and at
    every larger measured count; :data:`NEVER_SPLIT` if there is none.

    Pure. Requiring a win at every larger size keeps a noisy win below a loss from switching
    DBO on for the sizes in between. Rows need not be sorted; duplicate counts are an error.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    ordered = sorted(rows, key=lambda r: r.tokens)
    if len({r.tokens for r in ordered}) != len(ordered):
        raise ValueError("rows must have distinct token counts")
    threshold = NEVER_SPLIT
    for r in reversed(ordered):
        if r.dbo_ms is None or r.dbo_ms > r.serial_ms * (1 - margin):
            break
        threshold = r.tokens
    return threshold


def pick_schedule(rows: Sequence[AutotuneRow], margin: float = 0.02) -> tuple[ExpertSchedule, int]:
    """The schedule and threshold to run: ``(schedule, threshold)``. Pure.

    For each DBO schedule measured (``split``: ``dbo_ms``, ``merged``: ``merged_ms``,
    ``sbo+dbo``: ``sbo_dbo_ms``), its threshold is :func:`pick_threshold` of its times, and its
    cost is the sum over the measured sizes of its time (from the threshold on) or the plain
    time (below it), each relative to the plain time, so that every size weighs the same.
    ``plain`` costs one per size. The cheapest wins; ``merged`` and ``sbo+dbo`` must beat
    ``split``'s cost by ``margin`` (split is the default and they are alike where the schedule
    makes no difference). When no DBO schedule has a threshold the answer is
    ``(plain, NEVER_SPLIT)``. ``sbo`` (``sbo_ms``), which never splits,
    replaces that answer where it beat plain by ``margin`` at every size and its cost is lower by
    ``margin`` too: ``(sbo, NEVER_SPLIT)``.
    """
    costs: dict[ExpertSchedule, tuple[float, int]] = {}
    for schedule in SPLIT_SCHEDULES:
        timed = [AutotuneRow(r.tokens, r.serial_ms, r.ms(schedule)) for r in rows]
        thr = pick_threshold(timed, margin)
        if thr < NEVER_SPLIT:  # then it won somewhere, so it costs less than plain
            costs[schedule] = (sum((r.dbo_ms if r.tokens >= thr else r.serial_ms) / r.serial_ms
                                   for r in timed), thr)
    split = costs.get(ExpertSchedule.SPLIT)
    others = [(c, k, s) for k, (s, c) in enumerate(costs.items()) if s is not ExpertSchedule.SPLIT
              and (split is None or c[0] < split[0] * (1 - margin))]
    if others:
        cost, _, schedule = min(others, key=lambda o: (o[0][0], o[1]))
        choice = schedule, cost[1]
    elif split is not None:
        choice = ExpertSchedule.SPLIT, split[1]
    else:
        choice = ExpertSchedule.PLAIN, NEVER_SPLIT
    # sbo never splits: it runs at every size, so it counts only where it beat plain by the
    # margin at every measured size, and then only if it costs less than the choice above by it
    if rows and all(r.sbo_ms is not None and r.sbo_ms <= r.serial_ms * (1 - margin) for r in rows):
        best = (sum(r.ms(choice[0]) / r.serial_ms if r.tokens >= choice[1] else 1.0 for r in rows)
                if choice[0] is not ExpertSchedule.PLAIN else float(len(rows)))
        if sum(r.sbo_ms / r.serial_ms for r in rows) < best * (1 - margin):
            return ExpertSchedule.SBO, NEVER_SPLIT
    return choice


def autotune_split_config(
    fn: Callable[..., Any],
    make_inputs: Callable[[int], Sequence[torch.Tensor]],
    token_counts: Sequence[int],
    *,
    decode_only: bool,
    config: SplitConfig | None = None,
    group: Any = None,
    warmup: int = 2,
    steps: int = 10,
    rounds: int = 2,
    margin: float = 0.02,
    fn_kwargs: Mapping[str, Any] | None = None,
    sm_carveout: int | None = None,
    compute_sms: int | None = None,
    schedules: Sequence[ExpertSchedule | str] = (ExpertSchedule.SPLIT, ExpertSchedule.MERGED,
                                                 ExpertSchedule.SBO),
    sm_carveouts: Sequence[int | None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    options: RunOptions | None = None,
) -> AutotuneResult:
    """Time ``fn`` plainly and overlapped at each token count; return a tuned config.

    Args:
        fn: the forward, as given to :func:`dbo.overlapped_forward`.
        make_inputs: ``make_inputs(t)`` returns the token-major inputs ``[t, ...]`` of one
            forward on this rank (called once per count, before its timings).
        token_counts: tokens per rank to measure, e.g. ``[32, 64, 128, 256, 512]``; the same
            list on every rank.
        decode_only: tune ``decode_token_threshold`` (True) or ``prefill_token_threshold``.
        config: the config to tune (default :class:`SplitConfig`); its other fields (number
            of ubatches, split mode, padding) are used for the overlapped runs and kept.
        group: the process group the forward's collectives run over (None: the default group;
            ignored without torch.distributed).
        warmup, steps: calls before and inside each timed loop.
        rounds: plain and overlapped loops alternate this many times; each keeps its best.
        margin: DBO must be at least this much faster (0.02: 2%) to count as winning.
        fn_kwargs: passed to every call of ``fn``.
        sm_carveout: given to the overlapped runs (``overlapped_forward(sm_carveout=...)``):
            tune with the setting the wrapper will run with.
        compute_sms: likewise, the green-context SM count of the overlapped runs
            (``overlapped_forward(compute_sms=...)``).
        schedules: the expert schedules to measure beside the plain forward (default
            ``split``, ``merged`` and the unsplit ``sbo``; ``sbo+dbo`` where asked for); the
            choice is :func:`pick_schedule`'s.
        sm_carveouts: several carve-outs to measure the overlapped runs with (e.g. ``(None,
            16)``; replaces ``sm_carveout``). Each gets its schedule and threshold as above;
            the result keeps the one whose choice costs least over the measured sizes (the
            first unless another costs less by ``margin``) and names it in ``sm_carveout``.
            A carve-out keeps SMs free for the other ubatch's communication kernels
            (DeepEP's) and costs the matmuls those SMs: whether it pays depends on the
            backend and the shape.
        clock: what the timed loops read, in seconds (default :func:`time.perf_counter`; CUDA
            work is synchronized before each reading). Tests pass a deterministic one
            (:class:`dbo.testing.clock.VirtualClock`) whose time moves only when the forward
            says it spends time.
        options: how the timed calls run, one :class:`dbo.RunOptions` (the wrapper's
            ``options``), in place of ``sm_carveout`` and ``compute_sms``; its ``timeout_s``
            bounds every timed call, its ``trace`` records the overlapped ones.

    Returns:
        :class:`AutotuneResult`; ``.config`` is what to give the wrapper: the tuned threshold
        and, when DBO won, the chosen ``expert_schedule`` (one per config: it applies to the
        other kind's batches too).

    Raises:
        ValueError: an empty or non-positive ``token_counts``, bad ``steps``/``rounds``, or
            ``schedules``, or ranks that were given different ``token_counts``/``steps``/
            ``rounds``/``schedules``.
        TypeError: a ``clock`` that is not callable; ``options`` with ``sm_carveout`` or
            ``compute_sms``.
    """
    config = SplitConfig() if config is None else config
    counts = [int(t) for t in token_counts]
    if not counts or any(t <= 0 for t in counts) or len(set(counts)) != len(counts):
        raise ValueError(f"token_counts must be distinct positive ints, got {list(token_counts)!r}")
    if warmup < 0 or steps < 1 or rounds < 1:
        raise ValueError(f"need warmup >= 0, steps >= 1, rounds >= 1; got {warmup}, {steps}, {rounds}")
    if not callable(clock):
        raise TypeError(f"clock must be callable (returns seconds, like time.perf_counter), got {clock!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    options = RunOptions.given(options, sm_carveout=sm_carveout, compute_sms=compute_sms)
    carveouts = [options.sm_carveout] if sm_carveouts is None else \
        [check_sm_carveout(k) for k in sm_carveouts]
    if not carveouts or len(set(carveouts)) != len(carveouts):
        raise ValueError(f"sm_carveouts must be distinct and not empty, got {sm_carveouts!r}")
    # the runs of each carve-out (a plain call runs without one)
    runs = [dataclasses.replace(options, sm_carveout=k) for k in carveouts]
    wanted = {parse_expert_schedule(s) for s in schedules}
    if not wanted or ExpertSchedule.PLAIN in wanted:
        raise ValueError(f"schedules must name 'split', 'merged', 'sbo' or 'sbo+dbo' (the plain "
                         f"forward is always measured), got {list(schedules)!r}")
    dbo_schedules = [s for s in SPLIT_SCHEDULES if s in wanted]
    kwargs = dict(fn_kwargs or {})
    multi = group_size(group) > 1
    counts.sort()
    if multi:
        # One mismatch would make the ranks issue different collectives: check first.
        mine = [len(counts), sum(counts), steps, rounds, warmup,
                sum(1 << k for k, s in enumerate(ExpertSchedule) if s in wanted),
                len(carveouts), sum(-1 if k is None else k for k in carveouts)]
        seen = all_reduce_max(mine + [-v for v in mine], group)
        if seen[:len(mine)] != [-v for v in seen[len(mine):]]:
            raise ValueError("autotune_split_config: ranks were given different token_counts, "
                             "steps, rounds, warmup, schedules or sm_carveouts")
    force = dataclasses.replace(config, decode_token_threshold=1, prefill_token_threshold=1,
                                enabled=True, expert_schedule=ExpertSchedule.SPLIT)
    # per count: plain (serial), sbo, then the split schedules for each carve-out, in that order
    keys = [(s, k) for k in range(len(carveouts)) for s in SPLIT_SCHEDULES]
    width = 2 + len(keys)
    sbo = ExpertSchedule.SBO in wanted
    transient: dict[ExpertSchedule, int] = {}  # the overlapped calls' peak memory above their start
    per_row = 0  # the plain calls' peak above their start, per row
    local: list[float] = []
    for t in counts:
        inputs = list(make_inputs(t))
        device = device_of(inputs)
        plan = plan_ubatches(t, force, decode_only=decode_only, group=group)
        plain = sbo_ms = float("inf")
        unsplit = no_split_plan(t, expert_schedule=ExpertSchedule.SBO)
        best = dict.fromkeys(keys, float("inf"))
        def plain_call(x=inputs):
            with collective_timeout(options.timeout_s):
                return fn(*x, **kwargs)

        for r in range(rounds):
            plain = min(plain, time_ms(plain_call, warmup, steps, device, clock))
            if r == 0:  # one more call, once: what the plain call needs per row
                per_row = max(per_row, -(-transient_bytes(plain_call, device) // t))
            if sbo:
                sbo_ms = min(sbo_ms, time_ms(
                    lambda x=inputs, u=unsplit: overlapped_forward(fn, *x, plan=u, fn_kwargs=kwargs,
                                                                   options=options),
                    warmup, steps, device, clock))
            for (s, k) in keys if plan.split else ():
                if s not in dbo_schedules:
                    continue
                p = dataclasses.replace(plan, expert_schedule=s)
                def step(x=inputs, p=p, k=k):
                    return overlapped_forward(fn, *x, plan=p, fn_kwargs=kwargs, options=runs[k])
                best[(s, k)] = min(best[(s, k)], time_ms(step, warmup, steps, device, clock))
                if r == 0:  # one more call, once: its peak does not change between rounds
                    transient[s] = max(transient.get(s, 0), transient_bytes(step, device))
        local += [v if v != float("inf") else -1.0 for v in [plain, sbo_ms, *best.values()]]
        del inputs
    if multi:
        # the slowest rank sets the pace of a step; -1 (not measured) stays -1 on every rank
        ns = all_reduce_max([int(v * 1e6) if v >= 0 else -1 for v in local], group)
        local = [v / 1e6 if v >= 0 else -1.0 for v in ns]

    def ms(v: float) -> float | None:
        return None if v < 0 else v

    choices = []  # per carve-out: (cost, its index, rows, schedule, threshold)
    n_split = len(SPLIT_SCHEDULES)
    for k in range(len(carveouts)):
        col = 2 + n_split * k
        rows = tuple(AutotuneRow(t, local[width * i], ms(local[width * i + col]),
                                 ms(local[width * i + col + 1]), ms(local[width * i + 1]),
                                 ms(local[width * i + col + 2]))
                     for i, t in enumerate(counts))
        schedule, threshold = pick_schedule(rows, margin)
        cost = sum((r.ms(schedule) if r.tokens >= threshold else r.serial_ms) / r.serial_ms
                   for r in rows)
        choices.append((cost, k, rows, schedule, threshold))
    # the first carve-out unless another's choice costs less by the margin (noise stays put)
    chosen = choices[0]
    for c in choices[1:]:
        if c[0] < chosen[0] * (1 - margin):
            chosen = c
    _, k, rows, schedule, threshold = chosen
    field = "decode_token_threshold" if decode_only else "prefill_token_threshold"
    tuned = {field: threshold, "adaptive": False}  # measured here: the wrapper need not
    if schedule is not ExpertSchedule.PLAIN:
        tuned["expert_schedule"] = schedule
    need = [transient.get(s, 0) for s in SPLIT_SCHEDULES] + [per_row]
    if multi:
        need = all_reduce_max(need, group)
    need_bytes = dict(zip(SPLIT_SCHEDULES, need[:n_split], strict=True))
    if schedule.splits and need_bytes[schedule] > 0:
        # split only where a rank has the memory the overlapped call was measured to take
        tuned["min_free_bytes"] = int(need_bytes[schedule] * (1 + MEMORY_MARGIN))
    result = AutotuneResult(dataclasses.replace(config, **tuned), decode_only,
                            threshold, rows, margin, schedule, carveouts[k], tuple(carveouts),
                            int(need[n_split] * (1 + MEMORY_MARGIN)))
    logger.info("dbo autotune:\n%s", result.table())
    return result

