"""The wrapper as a user runs it, timed at the benchmark's shapes: the untuned one (the default,
adaptive :class:`dbo.split.SplitConfig`) and the one with the config :mod:`dbo.autotune` tuned
over the measured token counts, each alternated with the best serial configuration."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dbo.autotune import NEVER_SPLIT, autotune_split_config
from dbo.bench.overlap.options import OverlapOptions
from dbo.bench.overlap.record import AutotuneRecord, Measurement
from dbo.bench.overlap.shape import Budget, ShapeBench
from dbo.bench.overlap.summary import summarize
from dbo.bench.timing import Progress, measure
from dbo.overlap import DBOWrapper, overlapped_forward
from dbo.split import SplitConfig, Vote, local_vote

__all__ = ["time_wrapper", "tune_and_time_wrapper"]


def time_wrapper(sb: ShapeBench, config: SplitConfig, group: Any, rounds: int = 3,
                 mode: str = "wrapper") -> None:
    """Time the overlapped forward with ``config`` deciding (one all-reduce per step over
    ``group``, a gloo group on GPUs so that the decision does not wait for the GPU).

    Paired with the plain forward of the best serial configuration: the two alternate for
    ``rounds`` rounds and each keeps its best median (``mode``, and "serial_paired" after
    it: "serial_paired" for "wrapper"), so their ratio is not a drift between two moments
    of the run (the GPU's clocks move by a few percent over minutes); the order alternates
    too. An adaptive ``config`` (the untuned default) runs through a :class:`dbo.DBOWrapper`
    that first makes its measured choice (``online_choice`` in the record), then is timed."""
    paired_mode = "serial_paired" + mode[len("wrapper"):]
    if sb.budget.expired():
        sb.rec.measurements.append(Measurement(mode, skipped="time budget"))
        sb.progress.update(sb.label(mode) + " (skipped)")
        return
    fn = sb.adaptive_forward()
    decode = sb.opts.decode
    # the overlapped calls run with the best DBO run's carve-out (torch's and the experts'),
    # set for each call and restored after it; the plain ones with the run's --sm-carveout
    carveout = sb.best("dbo")[1]
    if config.adaptive:
        w = DBOWrapper(fn, config, group=group, compute_sms=sb.opts.dbo_compute_sms,
                       sm_carveout=carveout)

        def wrapped() -> torch.Tensor:
            return w(sb.x, decode_only=decode)

        sb.check_against(sb.ref, mode)(wrapped())
        plan = w.plan(sb.T, decode_only=decode)
        while plan.split and (w.online is None or w.online.choice(plan) is None):
            wrapped()  # the wrapper's measuring calls, before it is timed
        sb.rec.online_choice = (None if not plan.split else
                               {"chose": w.online.choice(plan).value, "table": w.online.table()})
    else:
        def wrapped() -> torch.Tensor:
            return overlapped_forward(fn, sb.x, config=config, decode_only=decode, group=group,
                                      compute_sms=sb.opts.dbo_compute_sms, sm_carveout=carveout)

        sb.check_against(sb.ref, mode)(wrapped())
    best: dict[str, Any] = {}
    pair = [(paired_mode, lambda: fn(sb.x)), (mode, wrapped)]
    for r in range(rounds):
        for name, step in (pair if r % 2 == 0 else pair[::-1]):  # neither always goes first
            t = measure(step, warmup=sb.opts.warmup, steps=sb.opts.steps, device=sb.device)
            if name not in best or t.median_ms < best[name].median_ms:
                best[name] = t
    for name, t in best.items():
        sb.rec.measurements.append(Measurement(name, timing=t, rounds=rounds))
    sb.progress.update(sb.label(mode))


def tune_and_time_wrapper(opts: OverlapOptions, benches: list[ShapeBench], budget: Budget,
                          progress: Progress, group: Any) -> tuple[AutotuneRecord, SplitConfig | None]:
    """dbo.autotune over the measured token counts of one model, then the wrapper with the
    tuned config at every shape; each shape's summary is recomputed with that wrapper time.
    Returns the autotune's record and the config it tuned (None where it did not run)."""
    ready = [sb for sb in benches if sb.rec.skipped is None and hasattr(sb, "ref")]
    if budget.expired() or not ready:
        progress.update("autotune (skipped)")
        return AutotuneRecord(ok=False, error="skipped: time budget" if ready else "no measured shape"), None
    by_tokens = {sb.T: sb for sb in ready}

    forwards = {t: sb.adaptive_forward() for t, sb in by_tokens.items()}
    current: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def make_inputs(t: int) -> list[torch.Tensor]:
        current[:] = [forwards[t]]
        return [by_tokens[t].x]

    def fn(x: torch.Tensor) -> torch.Tensor:
        return current[0](x)

    decode = opts.decode
    # the overlapped runs' carve-out: the shapes' best DBO one, or each of theirs where they differ
    carveouts = list(dict.fromkeys(sb.best("dbo")[1] for sb in ready))
    result = autotune_split_config(fn, make_inputs, sorted(by_tokens), decode_only=decode,
                                   group=group, warmup=opts.warmup, steps=max(5, opts.steps // 2),
                                   compute_sms=opts.dbo_compute_sms, sm_carveouts=carveouts)
    for sb in ready:
        sb.pf.reset()
        sb.pf_dbo.reset()
    progress.update(f"I={ready[0].model.dims.intermediate} autotune")
    res = AutotuneRecord(ok=True, decode_only=decode, threshold=result.threshold,
                         schedule=result.schedule.value, never_split=result.threshold >= NEVER_SPLIT,
                         margin=result.margin, rows=tuple(dataclasses.asdict(r) for r in result.rows),
                         table=result.table())
    for sb in ready:
        time_wrapper(sb, result.config, group)
        sb.pf.reset()
        sb.pf_dbo.reset()
        splits = local_vote(sb.T, result.config, decode_only=decode).vote is Vote.YES
        sb.rec.summary = summarize(sb.rec, splits, wrapper_config="autotuned")
    return res, result.config
