"""Logging each reason for running the plain forward once per process.

One process-wide registry, :data:`FALLBACK_LOG`, with ``reset()`` (the test fixture resets it
after every test), so a step that keeps falling back for the same reason logs it once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["FallbackLog", "FALLBACK_LOG"]

#: messages go to the ``dbo.split`` logger, where a user looking for split decisions looks
logger = logging.getLogger("dbo.split")


class FallbackLog:
    """The fallback reasons already logged in this process (one registry, with ``reset()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[Any] = set()

    def note(self, plan: Any) -> bool:
        """Log ``plan``'s fallback reason (a :class:`~dbo.split.UBatchPlan`) if it was not
        logged before; True if logged now."""
        if plan.split:
            return False
        with self._lock:
            if plan.reason in self._seen:
                return False
            self._seen.add(plan.reason)
        # a disagreement is the one fallback a user did not ask for on this rank
        level = logging.WARNING if plan.reason.value == "disagreement" else logging.INFO
        logger.log(level, "dbo: running the plain forward (reason: %s; %s); logged once per reason",
                   plan.reason.value, plan.detail)
        return True

    @property
    def seen(self) -> frozenset[Any]:
        return frozenset(self._seen)

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()


#: the process-wide registry of logged fallback reasons
FALLBACK_LOG = FallbackLog()
