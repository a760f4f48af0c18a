"""Which backend as well: the autotune once per all-to-all backend, and the fastest one.

:func:`autotune_backend` runs :func:`dbo.autotune.autotune_split_config` for each backend a
caller lets it try (switching the model's MoE layers with a callable it is given), then keeps the
backend whose forward, as the wrapper would run it with its tuned config, is fastest over the
measured sizes (:func:`pick_backend`), and leaves the model on it. So a ``DBOWrapper`` user gets
the fastest backend, schedule and threshold without reading tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.autotune.split import NEVER_SPLIT, AutotuneResult, autotune_split_config
from dbo.expert_schedule import ExpertSchedule

__all__ = ["BackendChoice", "wrapper_ms", "pick_backend", "autotune_backend"]

logger = logging.getLogger(__name__)



def wrapper_ms(result: AutotuneResult) -> list[float]:
    """Per measured size, the time of the forward the wrapper runs with ``result.config``: the
    chosen schedule from the threshold on, the plain forward below it."""
    out = []
    for r in result.rows:
        dbo = r.ms(result.schedule) if result.schedule is not ExpertSchedule.PLAIN else None
        out.append(dbo if dbo is not None and r.tokens >= result.threshold else r.serial_ms)
    return out


@dataclass(frozen=True)
class BackendChoice:
    """What :func:`autotune_backend` measured and chose: ``backend`` with its tuned ``result``;
    ``per_backend`` every backend's :class:`AutotuneResult`; ``costs`` each backend's cost (the
    sum over sizes of the wrapper's time over the fastest wrapper's at that size: 1 per size
    for a backend that is fastest everywhere)."""

    backend: str
    result: AutotuneResult
    per_backend: Mapping[str, AutotuneResult]
    costs: Mapping[str, float]

    def table(self) -> str:
        sizes = [r.tokens for r in self.result.rows]
        lines = [f"{'backend':>14} {'schedule':>8} {'threshold':>9} " + " ".join(f"{t:>9}" for t in sizes)
                 + f" {'cost':>6}"]
        for name, res in self.per_backend.items():
            thr = "never" if res.threshold >= NEVER_SPLIT else str(res.threshold)
            mark = " <-" if name == self.backend else ""
            lines.append(f"{name:>14} {res.schedule.value:>8} {thr:>9} "
                         + " ".join(f"{ms:>9.3f}" for ms in wrapper_ms(res))
                         + f" {self.costs[name]:>6.3f}{mark}")
        lines.append("ms per forward as the wrapper would run it (the schedule from the threshold on)")
        return "\n".join(lines)


def pick_backend(results: Mapping[str, AutotuneResult], margin: float = 0.02) -> tuple[str, dict[str, float]]:
    """The backend to run and every backend's cost. Pure.

    A backend's cost is the sum over the measured sizes of its wrapper time over the fastest
    backend's at that size (every size weighs the same). The first backend listed is the
    default: another must cost less by ``margin`` to be chosen.
    """
    if not results:
        raise ValueError("pick_backend needs at least one backend's result")
    times = {name: wrapper_ms(res) for name, res in results.items()}
    sizes = {tuple(r.tokens for r in res.rows) for res in results.values()}
    if len(sizes) != 1:
        raise ValueError(f"the backends were measured at different sizes: {sorted(sizes)}")
    fastest = [min(col) for col in zip(*times.values(), strict=True)]
    costs = {name: sum(t / f for t, f in zip(ts, fastest, strict=True)) for name, ts in times.items()}
    first = next(iter(results))
    best = min(costs, key=lambda n: (costs[n], n != first))
    if best != first and costs[best] > costs[first] * (1 - margin):
        best = first
    return best, costs


def autotune_backend(
    fn: Callable[..., Any],
    make_inputs: Callable[[int], Sequence[torch.Tensor]],
    token_counts: Sequence[int],
    *,
    backends: Sequence[str],
    use_backend: Callable[[str], Any],
    decode_only: bool,
    margin: float = 0.02,
    **kwargs: Any,
) -> BackendChoice:
    """:func:`autotune_split_config` once per backend; returns the fastest backend and its tuned
    config, and leaves the model on that backend.

    Args:
        backends: the names to try, the default first (e.g. ``["deepep_ht", "copy_engine"]``).
        use_backend: ``use_backend(name)`` makes ``fn``'s MoE layers run on that backend (for a
            transformers model loaded with dbo's implementations:
            ``lambda b: dbo.integrations.transformers.ep_model.switch_ep_backend(model, b)``).
            Collective where
            building a backend is; called in ``backends`` order on every rank, then once more
            with the choice.
        fn, make_inputs, token_counts, decode_only, margin, kwargs: as for
            :func:`autotune_split_config` (``group`` among them).

    Every rank gets the same answer: each backend's timings are the slowest rank's.
    """
    names = list(backends)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"backends must be distinct names, got {backends!r}")
    if not callable(use_backend):
        raise TypeError("use_backend must be callable: use_backend(name) switches fn's MoE layers")
    results: dict[str, AutotuneResult] = {}
    for name in names:
        use_backend(name)
        results[name] = autotune_split_config(fn, make_inputs, token_counts, decode_only=decode_only,
                                              margin=margin, **kwargs)
    best, costs = pick_backend(results, margin)
    use_backend(best)
    choice = BackendChoice(best, results[best], results, costs)
    logger.info("dbo autotune, backends:\n%s", choice.table())
    return choice
