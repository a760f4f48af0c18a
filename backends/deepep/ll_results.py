"""The bookkeeping of DeepEP low-latency results alive on one buffer (see
:mod:`dbo.backends.deepep_ll`): DeepEP keeps two low-latency receive buffers, and each launch
cleans the other one, so a launch must not happen while a receive is pending, and at most two
results may be alive at once."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from dbo.errors import DBOError
from dbo.ubatch.context import active_run, dbo_current_ubatch_id

__all__ = ["LowLatencyLimitError", "LowLatencyResults", "same_run"]

logger = logging.getLogger(__name__)

_NAME = "deepep_ll"


class LowLatencyLimitError(DBOError, RuntimeError):
    """A third low-latency result would be alive, or a launch would clobber a pending receive."""


@dataclass
class _Result:
    kind: str  # "dispatch" or "combine"
    ubatch: int
    run: Any  # the run it was launched in, or None outside a run
    received: bool = False

    def __str__(self) -> str:
        state = "received" if self.received else "receive pending"
        return f"ubatch {self.ubatch}'s {self.kind} ({state})"


class LowLatencyResults:
    """The low-latency results alive on one buffer (see the module docstring).

    Results left by an earlier run (one that failed, or whose step was abandoned) are dropped,
    with a warning, at the first launch of a new run; ``reset()`` drops everything.
    """

    LIMIT = 2

    def __init__(self) -> None:
        self._alive: dict[int, _Result] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._alive)

    def acquire(self, kind: str) -> int:
        run = active_run()
        self._drop_stale(run)
        pending = [r for r in self._alive.values() if not r.received]
        if pending:
            raise LowLatencyLimitError(
                f"{_NAME}: {kind} launched in ubatch {dbo_current_ubatch_id()} while the receive of "
                f"{pending[0]} has not run; DeepEP's next launch would clean that receive's buffer. "
                "Run the pending recv hook first (dbo_maybe_run_recv_hook).")
        if len(self._alive) >= self.LIMIT:
            alive = ", ".join(str(r) for r in self._alive.values())
            raise LowLatencyLimitError(
                f"{_NAME}: a {kind} in ubatch {dbo_current_ubatch_id()} would be the third low-latency "
                f"result alive (alive: {alive}). DeepEP keeps two low-latency buffers, so at most two "
                "results may be alive at once: use at most 2 ubatches with deepep_ll, and finish "
                "each combine before dispatching again.")
        token = next(self._ids)
        self._alive[token] = _Result(kind, dbo_current_ubatch_id(), run)
        return token

    def received(self, token: int) -> None:
        r = self._alive.get(token)
        if r is not None:
            r.received = True

    def release(self, token: int) -> None:
        self._alive.pop(token, None)

    def reset(self) -> None:
        self._alive.clear()

    def _drop_stale(self, run: Any) -> None:
        stale = [t for t, r in self._alive.items() if not same_run(r.run, run)]
        for t in stale:
            logger.warning("%s: dropping %s left by an earlier step", _NAME, self._alive.pop(t))


def same_run(ref: Any, run: Any) -> bool:
    """True if ``ref`` (the run a result was launched in, None outside a run) is ``run``.

    The run object itself is kept (runs are not weak-referenceable), so its identity cannot be
    reused while a result refers to it."""
    return ref is run
