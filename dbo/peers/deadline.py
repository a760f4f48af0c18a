"""Deadlines that end the process even while a C call holds the GIL.

A wait inside a C extension that does not release the GIL (DeepEP normal mode's host loop for the
receive counts, a collective buffer's destruction) stops every Python thread, the GPU watchdog's
(:mod:`dbo.peers.watchdog`) included. :func:`gil_free_deadline` and :func:`end_process_within`
are built on :func:`faulthandler.dump_traceback_later`, whose timer is a C thread: past the
deadline it writes every thread's stack on stderr and ends the process (exit status 1).
:func:`call_in_named_frame` makes the stuck call's frame name the wait, so that the stacks say
what was waited for. Everything here is re-exported by :mod:`dbo.peers.watchdog`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["gil_free_deadline", "call_in_named_frame", "end_process_within", "GIL_FREE_GRACE_S"]

logger = logging.getLogger("dbo.peers.watchdog")


def positive_seconds(seconds: Any, who: str) -> float:
    """``seconds`` as a float; ``ValueError`` naming ``who`` unless it is a positive number."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"{who} needs a positive number of seconds, got {seconds!r}")
    return float(seconds)


#: how long past its timeout a wait under :func:`gil_free_deadline` may run (the host's slack)
GIL_FREE_GRACE_S = 0.5


@contextlib.contextmanager
def gil_free_deadline(seconds: float) -> Iterator[None]:
    """End the process (exit code 1, every thread's Python stack on stderr after a
    ``Timeout (h:mm:ss)!`` line) if the block runs past ``seconds``, even while the thread in it
    holds the GIL: for a C call that waits on its peers without releasing it, such as DeepEP
    normal mode's host wait for the receive counts, during which no Python thread (the
    :data:`WATCHDOG` included) runs. Built on :func:`faulthandler.dump_traceback_later`, whose
    timer is a C thread: one per process, armed for the earliest deadline of the blocks open in
    any thread, so a block's end gives the others theirs back (the process's own use of
    ``dump_traceback_later`` is replaced while a block runs). Costs about 25 us (a thread start)
    per block.

    Raises:
        ValueError: ``seconds`` not a positive number.
    """
    seconds = positive_seconds(seconds, "gil_free_deadline")
    key = object()
    with _GIL_FREE_LOCK:
        _GIL_FREE_DEADLINES[key] = time.monotonic() + seconds
        _arm(min(_GIL_FREE_DEADLINES.values()))
    try:
        yield
    finally:
        with _GIL_FREE_LOCK:
            del _GIL_FREE_DEADLINES[key]
            if _GIL_FREE_DEADLINES:
                _arm(min(_GIL_FREE_DEADLINES.values()))
            else:
                faulthandler.cancel_dump_traceback_later()


def call_in_named_frame(what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, called from a frame whose file name is ``[dbo watchdog] {what}``:
    if :func:`gil_free_deadline` ends the process during the call, the stacks it writes on stderr
    name the wait (``File "[dbo watchdog] deepep_ht dispatch of ubatch 0 on rank 0: ...", line 2
    in named_wait``), as the GPU watchdog's own message does. Costs one more Python call."""
    return _named_frame(what)(fn, args, kwargs)


@functools.lru_cache(maxsize=256)
def _named_frame(what: str) -> Callable[[Callable[..., Any], tuple, dict], Any]:
    namespace: dict[str, Any] = {}
    exec(compile("def named_wait(fn, args, kwargs):\n    return fn(*args, **kwargs)\n",  # noqa: S102
                 f"[dbo watchdog] {what}", "exec"), namespace)
    return namespace["named_wait"]


def _arm(deadline: float) -> None:
    """faulthandler's timer for ``deadline`` (monotonic clock), writing to the process's real
    stderr (``sys.stderr`` may be replaced by an object without a file descriptor: a notebook, a
    captured test); where there is none, the deadline is not armed, said once in the log."""
    global _UNARMED_LOGGED
    out = sys.__stderr__
    try:
        faulthandler.dump_traceback_later(max(deadline - time.monotonic(), 1e-3), exit=True, file=out)
    except (AttributeError, OSError, RuntimeError, ValueError) as exc:
        if not _UNARMED_LOGGED:
            _UNARMED_LOGGED = True
            logger.warning("dbo: no GIL-free deadline in this process (stderr has no file "
                           "descriptor: %s); a wait that holds the GIL is bounded by its own timeout", exc)


_UNARMED_LOGGED = False

#: the deadlines (monotonic clock) of the open :func:`gil_free_deadline` blocks, of every thread,
#: and :func:`end_process_within`'s, which stays; the timer is armed for the earliest
_GIL_FREE_DEADLINES: dict[object, float] = {}
_GIL_FREE_LOCK = threading.Lock()
_PROCESS_END = object()


def end_process_within(seconds: float) -> None:
    """End the process (exit code 1, the stacks on stderr) ``seconds`` from now unless it has
    ended by itself, whatever runs meanwhile: for a program that failed and only tears down (a
    peer may be gone, and what waits on it, in C or in the interpreter's own shutdown, would
    hold the process forever). GIL-free, as :func:`gil_free_deadline`; it cannot be undone.

    Raises:
        ValueError: ``seconds`` not a positive number.
    """
    seconds = positive_seconds(seconds, "end_process_within")
    end = time.monotonic() + seconds
    with _GIL_FREE_LOCK:
        _GIL_FREE_DEADLINES[_PROCESS_END] = min(end, _GIL_FREE_DEADLINES.get(_PROCESS_END, end))
        _arm(min(_GIL_FREE_DEADLINES.values()))
