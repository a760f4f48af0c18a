"""A virtual clock for tests of code that times itself (the autotune), so they need no sleeps.

The forward under test says what it costs instead of sleeping: :meth:`VirtualClock.spend` for
work on the calling thread, :meth:`VirtualClock.send` and :meth:`VirtualClock.wait` for a
transfer that runs beside it on one link (transfers queue behind each other, as on one comm
stream). Time moves only through these calls, so a timing depends on the schedule alone: two
overlapped ubatches that each send, yield, wait and compute take max(compute, comm)-like time,
and the same run always gives the same numbers. Pass the clock where the real one is read
(``autotune_split_config(..., clock=clock)``).
"""

from __future__ import annotations

import math

__all__ = ["VirtualClock"]


def _check_seconds(seconds: float, what: str) -> float:
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")
    return value


class VirtualClock:
    """A clock in seconds that moves only when the code under test spends time.

    Call it (``clock()``) to read the time, as :func:`time.perf_counter`.
    """

    def __init__(self, start: float = 0.0):
        self._now = _check_seconds(start, "start")
        self._link_free = self._now

    def __call__(self) -> float:
        """The current time, seconds."""
        return self._now

    def spend(self, seconds: float) -> None:
        """The calling thread works for ``seconds``: the clock moves on by that much."""
        self._now += _check_seconds(seconds, "spend(seconds)")

    def send(self, seconds: float) -> float:
        """Start a transfer that takes ``seconds`` on the link, after those already queued;
        returns when it ends (give it to :meth:`wait`). The caller does not wait here."""
        start = max(self._now, self._link_free)
        self._link_free = start + _check_seconds(seconds, "send(seconds)")
        return self._link_free

    def wait(self, done_at: float) -> None:
        """Wait for a transfer that ends at ``done_at`` (from :meth:`send`): the clock moves on
        to it, or stays where it is if it ended already."""
        self._now = max(self._now, float(done_at))
