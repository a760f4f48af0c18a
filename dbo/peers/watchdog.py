"""One timeout for every collective wait, and a watchdog for the waits that run on the GPU.

A rank waits for its peers in two places, and a dead or stalled peer is caught in each:

* **on the host**, before it launches anything that waits for the peers (the backends'
  arrival check, :mod:`dbo.peers.arrival`, and the torch.distributed work waits): past the timeout
  the backend raises :class:`dbo.errors.CollectiveTimeoutError` naming the backend, the phase,
  the ubatch and the ranks that did not arrive. Nothing was launched, so the GPU stays usable;
* **inside a GPU kernel** that spins until the peers' data lands (DeepEP's receive loops):
  such a kernel cannot be interrupted from the host, and DeepEP's own kernel timeout is a
  compile-time constant of about 100 s that ends in a device trap. After each such launch the
  backend records a CUDA event on the stream and hands it to :data:`WATCHDOG`, a daemon thread
  that polls the pending events (``Event.query``, off the hot path); if one is still pending
  ``timeout_s`` after its launch, the watchdog logs the message, writes it to stderr and ends
  the process with exit code :data:`GPU_WAIT_TIMEOUT_EXIT_CODE`.

The hot path pays a counter write, one read per peer on the same host, and one event record
per launch; the polling runs on the watchdog thread.

The timeout is each backend's ``timeout_s``; :func:`collective_timeout` overrides it for
every backend called inside the block (``overlapped_forward(..., timeout_s=...)`` uses it).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dbo.errors import CollectiveTimeoutError
from dbo.peers.deadline import (
    GIL_FREE_GRACE_S,
    call_in_named_frame,
    end_process_within,
    gil_free_deadline,
    positive_seconds,
)

__all__ = [
    "GPU_WAIT_TIMEOUT_EXIT_CODE",
    "collective_timeout",
    "current_timeout",
    "resolve_timeout",
    "check_timeout",
    "WaitSite",
    "timeout_message",
    "raise_peer_timeout",
    "GpuWaitWatchdog",
    "WATCHDOG",
    "teardown_deadline",
    "gil_free_deadline",
    "call_in_named_frame",
    "GIL_FREE_GRACE_S",
    "end_process_within",
]

logger = logging.getLogger(__name__)

#: Exit status of a process the watchdog ended because a GPU wait on peers passed its timeout.
GPU_WAIT_TIMEOUT_EXIT_CODE = 75

_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("dbo_collective_timeout",
                                                                       default=None)


def check_timeout(timeout_s: Any, what: str = "timeout_s") -> float | None:
    """``timeout_s`` as a float (None stays None); ``ValueError`` unless it is positive."""
    return None if timeout_s is None else positive_seconds(timeout_s, what)


@contextlib.contextmanager
def collective_timeout(timeout_s: float | None) -> Iterator[None]:
    """Every backend called inside the block waits at most ``timeout_s`` seconds for its peers
    (instead of its own ``timeout_s``). ``None`` leaves the backends' own values. Per thread
    and per ubatch (a ``contextvars`` variable: ubatches start with a copy of the caller's)."""
    value = check_timeout(timeout_s)
    if value is None:
        yield
        return
    token = _TIMEOUT.set(value)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def current_timeout() -> float | None:
    """The innermost :func:`collective_timeout`'s value, or None outside any."""
    return _TIMEOUT.get()


def resolve_timeout(default_s: float) -> float:
    """The timeout in force: the innermost :func:`collective_timeout`, else ``default_s``."""
    value = _TIMEOUT.get()
    return default_s if value is None else value


@dataclass(frozen=True)
class WaitSite:
    """Where a rank waits for its peers: what the timeout message names.

    ``phase``: ``"dispatch"``/``"combine"``, with ``" send"``/``" receive"`` where the library
    splits the two (DeepEP low-latency with a recv hook).
    """

    backend: str
    phase: str
    ubatch: int
    rank: int


def timeout_message(site: WaitSite, timeout_s: float, missing: Sequence[int], detail: str = "",
                    where: str = "host") -> str:
    """The one wording of a peer timeout (the error's and the watchdog's)."""
    who = ("ranks " + ", ".join(str(r) for r in missing) if len(missing) > 1
           else f"rank {missing[0]}" if missing else "a peer rank")
    where_txt = ("" if where == "host" else
                 " (the wait runs inside a GPU kernel, which cannot be interrupted: ending the "
                 f"process with exit code {GPU_WAIT_TIMEOUT_EXIT_CODE})")
    return (f"{site.backend} {site.phase} of ubatch {site.ubatch} on rank {site.rank}: {who} did "
            f"not arrive within {timeout_s:.1f} s{'; ' + detail if detail else ''}{where_txt}")


# a pending wait: (event, deadline, timeout_s, site, describe_missing); a plain tuple, built
# on the hot path. ``site`` is a WaitSite or its fields as a tuple.
_Pending = tuple


def _end_process(message: str) -> None:
    logger.critical("%s", message)
    try:
        os.write(2, f"\n[dbo watchdog] {message}\n".encode())
    finally:
        os._exit(GPU_WAIT_TIMEOUT_EXIT_CODE)


@contextlib.contextmanager
def teardown_deadline(seconds: float, what: str = "teardown") -> Iterator[None]:
    """End the process (exit code :data:`GPU_WAIT_TIMEOUT_EXIT_CODE`, the message on stderr)
    if the block runs past ``seconds``. For the end of a program, once its results are written:
    freeing DeepEP's buffers and the process group waits on every peer (a device-wide sync, a
    barrier) and cannot be interrupted from the host, so a peer that never arrives there would
    otherwise keep the process alive forever. Before it ends the process it writes every
    thread's Python stack to stderr, so the log says which call never returned.

    Raises:
        ValueError: ``seconds`` not a positive number.
    """
    seconds = positive_seconds(seconds, "teardown_deadline")
    message = (f"{what} did not finish within {seconds:g} s (a peer never reached it, or a GPU "
               "wait never ended); the results were written before it. Where each thread was:")

    def expire() -> None:
        try:
            os.write(2, f"\n[dbo watchdog] {message}\n".encode())
            faulthandler.dump_traceback(all_threads=True)  # the stuck call, for the next run
        finally:
            _end_process(f"{what} did not finish within {seconds:g} s")

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        # the timer needs the GIL, which a C call that waits (DeepEP's buffer destruction) may
        # hold: the GIL-free deadline ends the process 2 s later in that case
        with gil_free_deadline(seconds + 2.0):
            yield
    finally:
        timer.cancel()


class GpuWaitWatchdog:
    """Pending GPU waits on peers, each with a deadline; a daemon thread polls them.

    ``watch(event, timeout_s, site, describe_missing)`` registers an event recorded right after
    a launch that waits for the peers. The thread (started on first use) queries the pending
    events every ``poll_s``; one still pending at its deadline calls ``on_expire(message)``
    (default: log, write to stderr, ``os._exit(GPU_WAIT_TIMEOUT_EXIT_CODE)``). Events are
    handed back to a pool once done, so a steady state allocates nothing.
    """

    def __init__(self, poll_s: float = 0.1,
                 on_expire: Callable[[str], None] | None = None):
        self.poll_s = poll_s
        self.on_expire: Callable[[str], None] = on_expire or _end_process
        self._incoming: collections.deque[_Pending] = collections.deque()
        self._pending: list[_Pending] = []
        self._free: collections.deque[Any] = collections.deque()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.fired: list[str] = []

    def __len__(self) -> int:
        return len(self._incoming) + len(self._pending)

    def cuda_event(self) -> Any:
        """A CUDA event from the pool (recorded by the caller, then passed to :meth:`watch`)."""
        try:
            return self._free.popleft()
        except IndexError:
            import torch

            return torch.cuda.Event()

    def watch(self, event: Any, timeout_s: float, site: WaitSite | tuple,
              describe_missing: Callable[[], tuple[list[int], str]] | None = None) -> None:
        """Expect ``event`` (anything with ``query()``) to complete within ``timeout_s``.

        ``site``: a :class:`WaitSite` or its fields as a tuple. ``describe_missing()`` (called
        only on expiry) returns the ranks that did not arrive and a detail for the message."""
        self._incoming.append((event, time.monotonic() + timeout_s, timeout_s, site, describe_missing))
        if self._thread is None:
            self._start()

    def record(self, timeout_s: float, site: WaitSite | tuple,
               describe_missing: Callable[[], tuple[list[int], str]] | None = None) -> None:
        """Record a pooled CUDA event on the current stream and :meth:`watch` it (the hot-path
        form: a pool pop, ``cudaEventRecord`` and a tuple appended)."""
        try:
            event = self._free.popleft()
        except IndexError:
            import torch

            event = torch.cuda.Event()
        event.record()
        self._incoming.append((event, time.monotonic() + timeout_s, timeout_s, site, describe_missing))
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="dbo-gpu-wait-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bad event
                logger.exception("dbo watchdog: polling failed")

    def poll(self, now: float | None = None) -> None:
        """One round: retire completed events (and those whose query fails: the CUDA context is
        lost, which the caller's next CUDA call raises), expire the first one past its deadline."""
        while self._incoming:
            self._pending.append(self._incoming.popleft())
        if not self._pending:
            return
        now = time.monotonic() if now is None else now
        still = []
        expired = None
        for p in self._pending:
            try:
                done = p[0].query()
            except RuntimeError:  # the CUDA context failed (a trap): the caller's next CUDA call
                continue          # raises it; the event is dropped, not pooled
            if done:
                if hasattr(p[0], "record"):
                    self._free.append(p[0])
            else:
                still.append(p)
                if expired is None and now > p[1]:
                    expired = p
        self._pending = still
        if expired is not None:
            self._expire(expired)

    def _expire(self, p: _Pending) -> None:
        _, _, timeout_s, site, describe_missing = p
        missing, detail = [], ""
        if describe_missing is not None:
            try:
                missing, detail = describe_missing()
            except Exception as exc:  # noqa: BLE001 - the message must still go out
                detail = f"(could not read the peers' progress: {exc})"
        site = site if isinstance(site, WaitSite) else WaitSite(*site)
        message = timeout_message(site, timeout_s, missing, detail, where="gpu")
        self._pending.remove(p)
        self.fired.append(message)
        self.on_expire(message)

    def reset(self) -> None:
        """Forget every pending wait (tests; or a caller that abandons a step on purpose)."""
        self._incoming.clear()
        self._pending.clear()
        self.fired.clear()

    def stop(self) -> None:
        """Stop the thread (it restarts on the next :meth:`watch`)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        self._thread = None


#: The process-wide watchdog (one object with ``reset()``, per the house rules).
WATCHDOG = GpuWaitWatchdog()


def raise_peer_timeout(site: WaitSite, timeout_s: float, missing: Sequence[int],
                       detail: str = "") -> None:
    """Raise the :class:`CollectiveTimeoutError` of a host wait that ran out."""
    raise CollectiveTimeoutError(timeout_message(site, timeout_s, missing, detail),
                                 backend=site.backend, phase=site.phase, ubatch=site.ubatch,
                                 missing_ranks=tuple(missing))
