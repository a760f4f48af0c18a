"""What a run of ``python -m dbo.bench experts`` measured, as typed records: a run
(:class:`ExpertsResult`) holds the device's measured limits and an :class:`ExpertsRow` per case
(one shape of the grid); a row holds an :class:`ImplTiming` per implementation and timing
(``NAME``, ``NAME, from idle``).

:func:`dbo.bench.experts.command.run_grid` makes the rows as it measures them,
:func:`~dbo.bench.experts.command.add_limits` gives them their limits; the table, the verdict
and the ``--json`` file read them. ``to_json`` writes the ``--json`` document (``limits``,
``rows``, ``summary``: the keys it has always had, a row's and a timing's only where they have a
value) and ``from_json`` reads one back, so ``from_json(r.to_json()).to_json() == r.to_json()``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dbo.bench.limits import DeviceLimits

__all__ = ["ImplTiming", "ExpertsRow", "ExpertsResult", "limit_summary"]


@dataclass(frozen=True)
class ImplTiming:
    """One implementation's calls on a case, in ms: the ``median_ms``, ``p10_ms`` and ``p90_ms``
    of its timed calls, ``host_ms`` the median host time of a call, ``rel_err`` its output
    against the first implementation's on the rows that arrived; with the row's limit,
    ``x_limit`` (median over the limit) and, where the held GEMM rate was measured, ``x_held``
    (over the limit at that rate)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    rel_err: float
    host_ms: float
    x_limit: float | None = None
    x_held: float | None = None

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, float]) -> ImplTiming:
        return cls(**d)


#: the row's keys that its JSON has only where they have a value
_ROW_OPTIONAL = ("ranks", "capacity", "limit_ms", "limit_bound", "held_limit_ms")


@dataclass(frozen=True)
class ExpertsRow:
    """One case: its ``layout`` (``standard`` or ``batched``), ``hidden`` and ``intermediate``
    sizes, the rank's ``local_experts`` and ``tokens``, the (token, expert) pairs routed to the
    rank (``local_pairs``) and the experts that got any (``experts_with_rows``), and the
    ``results`` by implementation name. Batched only: ``ranks`` and each slab's ``capacity``.
    With limits: ``limit_ms`` (:func:`dbo.bench.limits.experts_cost` at the measured rates),
    what bounds it (``limit_bound``: ``flops`` or ``bytes``) and, where the held GEMM rate was
    measured, ``held_limit_ms``."""

    layout: str
    hidden: int
    intermediate: int
    local_experts: int
    tokens: int
    local_pairs: int
    experts_with_rows: int
    results: dict[str, ImplTiming] = field(default_factory=dict)
    ranks: int | None = None
    capacity: int | None = None
    limit_ms: float | None = None
    limit_bound: str | None = None
    held_limit_ms: float | None = None

    @property
    def pairs_per_expert(self) -> float:
        """The pairs per expert that has any."""
        return self.local_pairs / max(1, self.experts_with_rows or self.local_experts)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "results":
                d["results"] = {name: t.to_json() for name, t in value.items()}
            elif value is not None or f.name not in _ROW_OPTIONAL:
                d[f.name] = value
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ExpertsRow:
        return cls(**{**d, "results": {name: ImplTiming.from_json(t)
                                       for name, t in d.get("results", {}).items()}})


def limit_summary(rows: Sequence[ExpertsRow]) -> dict[str, dict[str, float]]:
    """Per implementation whose every row has its ratio to the limit: the geometric mean and the
    worst of ``x_limit`` over the rows (``geomean_x_limit``, ``worst_x_limit``) and, where every
    row has it, the geometric mean of ``x_held`` (``geomean_x_held``)."""
    out: dict[str, dict[str, float]] = {}
    for name in (rows[0].results if rows else {}):
        res = [r.results[name] for r in rows]
        xs = [x.x_limit for x in res]
        if any(x is None for x in xs):
            continue
        out[name] = {"geomean_x_limit": statistics.geometric_mean(xs), "worst_x_limit": max(xs)}
        if all(x.x_held is not None for x in res):
            out[name]["geomean_x_held"] = statistics.geometric_mean(x.x_held for x in res)
    return out


@dataclass(frozen=True)
class ExpertsResult:
    """A run: the device's ``limits`` (measured at its start) and its ``rows``, one per case in
    the grid's order. ``to_json`` is the ``--json`` document (with the :func:`limit_summary` of
    the rows); ``from_json`` reads one back."""

    limits: DeviceLimits
    rows: tuple[ExpertsRow, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))

    @property
    def names(self) -> list[str]:
        """The implementations (and timings) in the order they were timed; the first is the
        baseline."""
        return list(self.rows[0].results) if self.rows else []

    def summary(self) -> dict[str, dict[str, float]]:
        """:func:`limit_summary` of the rows."""
        return limit_summary(self.rows)

    @property
    def worst_rel_err(self) -> float:
        """The largest output error of any implementation against the first (0 without rows)."""
        return max((t.rel_err for r in self.rows for t in r.results.values()), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"limits": self.limits.as_dict(), "rows": [r.to_json() for r in self.rows],
                "summary": self.summary()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ExpertsResult:
        return cls(DeviceLimits(**d["limits"]), tuple(ExpertsRow.from_json(r) for r in d.get("rows", ())))
