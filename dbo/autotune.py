"""Measure where dual-batch overlap starts to pay on this machine and set the thresholds.

Whether two overlapped ubatches beat one plain forward depends on the model, the batch size
and the machine: DBO hides communication behind compute, but each ubatch runs every local
expert, so the expert weights are read once per ubatch, and small batches are bound by that
read. On two H200s joined by NVLink, DeepEP low-latency decode lost at every batch size
measured (docs/perf_notes.md). :func:`autotune_split_config` times the plain and the
overlapped forward at a few token counts and returns a :class:`~dbo.split.SplitConfig` whose
threshold splits only where DBO was faster, so that the wrapper picks the faster mode.

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

from dbo.overlap import _check_carveout, overlapped_forward
from dbo.partition import check_num_sms
from dbo.split import NEVER_SPLIT, SplitConfig, _group_size, _reduce_max, plan_ubatches

__all__ = [
    "NEVER_SPLIT",
    "AutotuneRow",
    "AutotuneResult",
    "pick_threshold",
    "autotune_split_config",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class AutotuneRow:
    """One token count: the plain and the overlapped forward, ms per call (slowest rank).

    ``dbo_ms`` is None where the batch could not be split (fewer tokens than ubatches).
    """

    tokens: int
    serial_ms: float
    dbo_ms: float | None

    @property
    def ratio(self) -> float | None:
        """DBO / serial (< 1: DBO is faster)."""
        return None if self.dbo_ms is None else self.dbo_ms / self.serial_ms


@dataclass(frozen=True)
class AutotuneResult:
    """What :func:`autotune_split_config` measured and chose.

    Attributes:
        config: the input config with the tuned threshold (decode or prefill).
        decode_only: which threshold was tuned.
        threshold: the smallest token count from which DBO won at every measured size, or
            :data:`NEVER_SPLIT` if it won at none (or not at the largest).
        rows: the measurements, by increasing token count.
        margin: how much faster DBO had to be to count as winning.
    """

    config: SplitConfig
    decode_only: bool
    threshold: int
    rows: tuple[AutotuneRow, ...]
    margin: float

    def table(self) -> str:
        """The measurements as a small text table."""
        kind = "decode" if self.decode_only else "prefill"
        lines = [f"{'tokens':>8} {'serial ms':>10} {'dbo ms':>10} {'dbo/serial':>11}"]
        for r in self.rows:
            d = "-" if r.dbo_ms is None else f"{r.dbo_ms:.3f}"
            q = "-" if r.ratio is None else f"{r.ratio:.3f}"
            lines.append(f"{r.tokens:>8} {r.serial_ms:>10.3f} {d:>10} {q:>11}")
        thr = "never" if self.threshold >= NEVER_SPLIT else f">= {self.threshold} tokens"
        lines.append(f"{kind} threshold: split {thr} (DBO must win by {100 * self.margin:.0f}%)")
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(step: Callable[[], Any], warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


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

    Returns:
        :class:`AutotuneResult`; ``.config`` is what to give the wrapper.

    Raises:
        ValueError: an empty or non-positive ``token_counts``, bad ``steps``/``rounds``, or
            ranks that were given different ``token_counts``/``steps``/``rounds``.
    """
    config = SplitConfig() if config is None else config
    counts = [int(t) for t in token_counts]
    if not counts or any(t <= 0 for t in counts) or len(set(counts)) != len(counts):
        raise ValueError(f"token_counts must be distinct positive ints, got {list(token_counts)!r}")
    if warmup < 0 or steps < 1 or rounds < 1:
        raise ValueError(f"need warmup >= 0, steps >= 1, rounds >= 1; got {warmup}, {steps}, {rounds}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    _check_carveout(sm_carveout)
    check_num_sms(compute_sms)
    kwargs = dict(fn_kwargs or {})
    multi = _group_size(group) > 1
    counts.sort()
    if multi:
        # One mismatch would make the ranks issue different collectives: check first.
        mine = [len(counts), sum(counts), steps, rounds, warmup]
        seen = _reduce_max(mine + [-v for v in mine], group, None)
        if seen[:5] != [-v for v in seen[5:]]:
            raise ValueError("autotune_split_config: ranks were given different token_counts, "
                             "steps, rounds or warmup")
    force = dataclasses.replace(config, decode_token_threshold=1, prefill_token_threshold=1,
                                enabled=True)
    local: list[float] = []
    for t in counts:
        inputs = list(make_inputs(t))
        device = _device_of(inputs)
        plan = plan_ubatches(t, force, decode_only=decode_only, group=group)
        best = {"serial": float("inf"), "dbo": float("inf")}
        for _ in range(rounds):
            best["serial"] = min(best["serial"], _time_ms(lambda x=inputs: fn(*x, **kwargs),
                                                          warmup, steps, device))
            if plan.split:
                best["dbo"] = min(best["dbo"], _time_ms(
                    lambda x=inputs, p=plan: overlapped_forward(fn, *x, plan=p, fn_kwargs=kwargs,
                                                                  sm_carveout=sm_carveout,
                                                                  compute_sms=compute_sms),
                    warmup, steps, device))
        local += [best["serial"], best["dbo"] if plan.split else -1.0]
        del inputs
    if multi:
        # the slowest rank sets the pace of a step; -1 (not split) stays -1 on every rank
        ns = _reduce_max([int(v * 1e6) if v >= 0 else -1 for v in local], group, None)
        local = [v / 1e6 if v >= 0 else -1.0 for v in ns]
    rows = tuple(AutotuneRow(t, local[2 * k], None if local[2 * k + 1] < 0 else local[2 * k + 1])
                 for k, t in enumerate(counts))
    threshold = pick_threshold(rows, margin)
    field = "decode_token_threshold" if decode_only else "prefill_token_threshold"
    result = AutotuneResult(dataclasses.replace(config, **{field: threshold}), decode_only,
                            threshold, rows, margin)
    logger.info("dbo autotune:\n%s", result.table())
    return result
