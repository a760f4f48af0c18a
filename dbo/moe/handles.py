"""Per-ubatch slots for state that lives between a backend's ``prepare`` and ``finalize``.

Two ubatches interleave ``prepare``/``finalize`` on one backend object, so its dispatch
metadata (send indices, receive counts, work handles) is kept per ubatch, indexed by
``dbo_current_ubatch_id()``.
"""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

from dbo.moe.errors import MoEProtocolError
from dbo.ubatch.context import dbo_current_ubatch_id

__all__ = ["PerUBatch"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PerUBatch(Generic[T]):
    """One value per ubatch id: ``put`` in ``prepare``, ``take`` in ``finalize``.

    ``name`` appears in error messages (e.g. ``"all2all dispatch handle"``).
    """

    def __init__(self, name: str):
        self.name = name
        self._slots: dict[int, T] = {}

    def put(self, value: T, *, strict: bool = False) -> None:
        """Store ``value`` for the running ubatch.

        A value still there is left over from a step that failed between prepare and
        finalize: replaced with a log line, or ``MoEProtocolError`` if ``strict``.
        """
        ub = dbo_current_ubatch_id()
        if ub in self._slots:
            if strict:
                raise MoEProtocolError(f"{self.name}: prepare called twice in ubatch {ub} "
                                       "without a finalize in between")
            logger.debug("%s: dropping a stale value of ubatch %d", self.name, ub)
        self._slots[ub] = value

    def take(self, what: str = "finalize") -> T:
        """Remove and return the running ubatch's value (``what``: the call that takes it, for
        the error where there is none)."""
        ub = dbo_current_ubatch_id()
        try:
            return self._slots.pop(ub)
        except KeyError:
            raise MoEProtocolError(f"{self.name}: {what} called in ubatch {ub} with no "
                                   "prepare before it") from None

    def peek(self) -> T | None:
        """The running ubatch's value, left in place (None if there is none)."""
        return self._slots.get(dbo_current_ubatch_id())

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        self._slots.clear()
