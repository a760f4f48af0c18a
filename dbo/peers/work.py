"""A collective's work whose wait returns only once gloo has let go of it.

Why: ProcessGroupGloo runs each collective on one of its worker threads, which keeps its own
reference to the work until a moment after marking it complete. So ``work.wait()`` can return,
and the caller drop its handle, while the worker still holds the last reference; the worker then
destroys the work, and releasing a tensor that has a Python object takes the GIL. If by then the
interpreter has begun to finalize (a program that ends right after its last collective),
CPython ends any thread other than the main one that takes the GIL with ``pthread_exit``; its
unwinding meets the work's ``noexcept`` destructor and calls ``std::terminate``: the process
prints "terminate called without an active exception" and dies of SIGABRT after the program has
finished. ``destroy_process_group()`` does not prevent it (the worker threads were still running
in ``Py_FinalizeEx`` after it, torch 2.13); a barrier before the end does in practice: while
the main thread waits in it, the worker gets the GIL.

How: :class:`LentWork` hands the collective fresh aliases of its tensors (``detach()``: the same
storage, shape and strides, a tensor object of its own) and keeps only weak references to them,
so each alias lives exactly as long as the work holds it. :meth:`LentWork.wait` waits for the
work, drops the handle, then gives up the GIL until the aliases are gone: at once if the handle
was the last reference (the work is freed on this thread), else as soon as the worker has freed
it. After that no gloo thread needs the GIL for this work, and the program may end at any
moment. An alias must not be a view (``t.view(...)``): a view holds its base tensor, whose Python
object then outlives the caller's last reference and is freed by the worker with the view, a
moment after the view's own object, when the weak reference already says the work is gone.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

__all__ = ["LentWork", "RELEASE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: how long :meth:`LentWork.wait` waits, after the work is complete, for gloo's worker thread to
#: free it (it needs only the GIL, which this thread gives up meanwhile: microseconds); past it
#: something else holds the work, and the wait returns with a warning
RELEASE_TIMEOUT_S = 1.0


class LentWork:
    """One collective, issued on aliases of ``tensors`` that only its work holds.

    Args:
        issue: called once, at construction, with one alias per tensor of ``tensors`` (same
            shape, strides, dtype and storage: what the collective writes into an alias lands in
            the tensor; no reference to the tensor itself), in that order; it starts the
            collective with ``async_op=True`` and returns its work handle (``None`` where there
            is nothing to wait for).
        tensors: the tensors the collective reads and writes.
        lend: hand the collective aliases (gloo). False passes ``tensors`` themselves and skips
            the release wait (NCCL, whose work waits are stream waits).

    Nothing else may keep the work handle: only :meth:`wait` drops it.
    """

    def __init__(self, issue: Callable[..., Any], tensors: Sequence[torch.Tensor], *,
                 lend: bool = True):
        if lend:
            aliases = [t.detach() for t in tensors]  # not views: see the module's docstring
            self._lent = [weakref.ref(a) for a in aliases]
            self._work = issue(*aliases)
        else:
            self._lent = []
            self._work = issue(*tensors)
        if self._work is None:
            self._lent = []

    @property
    def pending(self) -> bool:
        """True until :meth:`wait` has seen the work complete."""
        return self._work is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the work (at most ``timeout_s`` seconds where given), then, once it is
        complete, until gloo's worker thread has freed it (and with it the aliases).

        Returns what the work's ``wait`` returns (True once complete; a backend that reports a
        timeout with False leaves the work pending). Raises what the work's ``wait`` raises (gloo:
        ``RuntimeError`` on its timeout or a peer's failure); the work then stays pending.
        """
        work = self._work
        if work is None:
            return True
        done = work.wait() if timeout_s is None else work.wait(timeout=timedelta(seconds=timeout_s))
        if done is False:
            return False
        self._work = None
        del work
        self._await_release()
        return True if done is None else done

    def _await_release(self) -> None:
        if not self._held():
            return
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        pause = 1e-5
        while self._held():
            if time.monotonic() > deadline:
                logger.warning("a completed collective's work was not freed within %.1f s of its "
                               "wait: something besides the LentWork holds it (the process may "
                               "abort at exit if it is freed by gloo's thread then)",
                               RELEASE_TIMEOUT_S)
                break
            time.sleep(pause)  # gives up the GIL, which gloo's worker needs to free the work
            pause = min(2 * pause, 1e-3)
        self._lent = []

    def _held(self) -> bool:
        return any(ref() is not None for ref in self._lent)
