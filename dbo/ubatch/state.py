"""One ubatch's state: its id, streams, events, recv-hook slot and the greenlet it runs in.

:class:`UBatchContext` does what a ``dbo_*`` function asks of the running ubatch (switch
streams with their event record/wait pairs, register and run recv hooks); yielding goes
through the run's driver (:mod:`dbo.ubatch.driver`), the only code that resumes a ubatch.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Protocol

import greenlet

from dbo.errors import HookMisuseError, HookSlotOccupiedError, StreamStateError

__all__ = ["DONE", "FAILED", "RecvHook", "RunView", "UBatchContext"]

RecvHook = Callable[[], Any]

# What a ubatch's greenlet returns to the driver: (DONE, result) or (FAILED, exception).
DONE = object()
FAILED = object()


class RunView(Protocol):
    """What a ubatch reads and calls of its run (:class:`dbo.ubatch.driver.Run` is the one
    implementation; the driver imports this module, not the other way round)."""

    streams: Any
    trace: Any
    driver: greenlet.greenlet
    compute_key: Any
    comm_key: Any
    caller_modes: Any
    in_hook: bool
    current: UBatchContext | None
    contexts: list[UBatchContext]
    yield_current: Callable[[], None]

    def next_live(self, idx: int) -> UBatchContext | None: ...


class UBatchContext:
    """State of one ubatch: id, streams, events, recv-hook slot and token offset.

    ``compute_stream`` is the caller's current stream when the run started; ``comm_stream`` is
    shared by all ubatches of the run. ``compute_done_event`` / ``comm_done_event`` are this
    ubatch's own events (recorded by the ``*_sync`` switches and the yield-and-switch calls).

    What the driver (:mod:`dbo.ubatch.driver`) reads and writes: ``modes``, ``stream_key`` and
    ``torch_stacks``, the thread state saved when this ubatch was last switched away (fields,
    not methods: the driver's switch reads and writes them on every yield, the hot path;
    ``torch_stacks``, what :meth:`dbo.ubatch.mode_stacks.ModeStacks.take` returned, is None while
    the ubatch runs and whenever it holds no mode stacks); ``started``, ``live`` and
    ``result``; ``hook_pending_in``, the ubatch whose slot holds the hook this one registered
    and that has not run yet (run it with :meth:`run_hook_in`). Its greenlet only through
    :meth:`resume`, :meth:`resumer`, :meth:`throw_exit` and :attr:`finished`; its hook slot
    through :meth:`drop_hooks`.
    """

    __slots__ = (
        "id", "token_offset", "compute_stream", "comm_stream", "compute_done_event",
        "comm_done_event", "_run", "_streams", "_compute_key", "_comm_key", "_greenlet",
        "modes", "stream_key", "torch_stacks", "_hook", "_hook_registrant", "hook_pending_in",
        "started", "live", "result",
    )

    def __init__(self, run: RunView, idx: int, fn: Callable[[], Any], token_offset: int,
                 events: tuple[Any, Any]):
        streams = run.streams
        self.id = idx
        self.token_offset = token_offset
        self._run = run
        self._streams = streams
        self._compute_key = run.compute_key
        self._comm_key = run.comm_key
        self.compute_stream = streams.stream(run.compute_key)
        self.comm_stream = streams.stream(run.comm_key)
        self.compute_done_event, self.comm_done_event = events
        self._greenlet = greenlet.greenlet(self.body(fn), parent=run.driver)
        self._greenlet.gr_context = contextvars.copy_context()
        self.modes = run.caller_modes
        self.stream_key = run.compute_key
        self.torch_stacks: Any = None
        self._hook: RecvHook | None = None
        self._hook_registrant = -1
        self.hook_pending_in: UBatchContext | None = None
        self.started = False
        self.live = True
        self.result: Any = None

    def body(self, fn: Callable[[], Any]) -> Callable[[], tuple]:
        """The function this ubatch's greenlet runs: ``fn()``, then the hook left in this
        ubatch's slot; returns ``(DONE, result)`` or ``(FAILED, exception)`` to the driver
        (replaceable in tests: see :mod:`dbo.ubatch.driver`)."""

        def body() -> tuple:
            self.started = True
            try:
                result = fn()
                self.maybe_run_recv_hook()
            except BaseException as exc:  # noqa: BLE001 - handed to the driver, which re-raises
                return (FAILED, exc)
            return (DONE, result)

        return body

    @property
    def current_stream(self) -> Any:
        """This ubatch's current stream (a ``torch.cuda.Stream`` or a ``LogicalStream``)."""
        key = self._streams.current() if self._run.current is self else self.stream_key
        return self._streams.stream(key)

    # ---- the driver's handles on the greenlet and the hook slot ------------------------

    def resume(self) -> Any:
        """Switch into this ubatch's greenlet; returns what the greenlet hands back (its
        ``(DONE, result)`` or ``(FAILED, exception)`` when its callable ends)."""
        return self._greenlet.switch()

    def resumer(self) -> Callable[[], Any]:
        """:meth:`resume` as one bound callable (for the driver's switch, built once per run)."""
        return self._greenlet.switch

    def throw_exit(self) -> Any:
        """Throw ``GreenletExit`` into this ubatch, so that its ``finally`` blocks run."""
        return self._greenlet.throw(greenlet.GreenletExit)

    @property
    def finished(self) -> bool:
        """True once this ubatch's greenlet has ended."""
        return self._greenlet.dead

    def drop_hooks(self) -> None:
        """Forget the hook in this ubatch's slot and the one it left pending elsewhere."""
        self._hook = None
        self.hook_pending_in = None

    # ---- yielding ----------------------------------------------------------------------

    def yield_(self) -> None:
        """Let the next live ubatch in ring order run; return when this one is resumed."""
        self._run.yield_current()

    # ---- streams -----------------------------------------------------------------------

    def _set_stream(self, key: Any, name: str) -> None:
        self._streams.set_current(key)
        trace = self._run.trace
        if trace is not None:
            trace.record("stream", self.id, name)

    def _record(self, event: Any, key: Any, name: str) -> None:
        self._streams.record(event, self._streams.stream(key))
        trace = self._run.trace
        if trace is not None:
            trace.record("record", self.id, name)

    def _wait(self, key: Any, event: Any, name: str) -> None:
        self._streams.wait(self._streams.stream(key), event)
        trace = self._run.trace
        if trace is not None:
            trace.record("wait", self.id, name)

    def switch_to_comm(self) -> None:
        self._set_stream(self._comm_key, "comm")

    def switch_to_compute(self) -> None:
        self._set_stream(self._compute_key, "compute")

    def _switch_after(self, src_key: Any, src_name: str, dst_key: Any, dst_name: str,
                      yield_between: bool = False) -> None:
        """Record this ubatch's ``src_name``-done event on the stream it leaves, optionally
        yield, then make ``dst_key`` current and have it wait for that event."""
        event = self.compute_done_event if src_key == self._compute_key else self.comm_done_event
        label = f"ub{self.id}.{src_name}_done"
        self._record(event, src_key, label)
        if yield_between:
            self.yield_()
        self._set_stream(dst_key, dst_name)
        self._wait(dst_key, event, label)

    def _require_current(self, key: Any, name: str, caller: str) -> None:
        if self._streams.current() != key:
            raise StreamStateError(f"{caller} called while the current stream is not the {name} "
                                   "stream")

    def switch_to_comm_sync(self) -> None:
        """Switch to the comm stream, which first waits for this ubatch's compute so far."""
        self._switch_after(self._compute_key, "compute", self._comm_key, "comm")

    def switch_to_compute_sync(self) -> None:
        """Switch to the compute stream, which first waits for this ubatch's comm so far."""
        self._switch_after(self._comm_key, "comm", self._compute_key, "compute")

    def switch_to_compute_deferred(self) -> Callable[[], None]:
        """Switch to the compute stream without waiting; return ``wait()``, which makes the
        compute stream wait for this ubatch's comm so far.

        Work queued between the switch and ``wait()`` (a shared expert) runs alongside the
        comm. ``wait()`` must come before anything reads the comm's results; calling it after
        a later ``*_sync`` switch waits for that later point instead (never for less).
        """
        self._record(self.comm_done_event, self._comm_key, f"ub{self.id}.comm_done")
        self._set_stream(self._compute_key, "compute")

        def wait() -> None:
            self._wait(self._compute_key, self.comm_done_event, f"ub{self.id}.comm_done")

        return wait

    def yield_and_switch_from_compute_to_comm(self) -> None:
        """Mark our compute done, yield, then continue on the comm stream after that compute."""
        self._require_current(self._compute_key, "compute", "dbo_yield_and_switch_from_compute_to_comm")
        self._switch_after(self._compute_key, "compute", self._comm_key, "comm", yield_between=True)

    def yield_and_switch_from_comm_to_compute(self) -> None:
        """Mark our comm done, yield, then continue on the compute stream after that comm."""
        self._require_current(self._comm_key, "comm", "dbo_yield_and_switch_from_comm_to_compute")
        self._switch_after(self._comm_key, "comm", self._compute_key, "compute", yield_between=True)

    # ---- recv hooks --------------------------------------------------------------------

    def register_recv_hook(self, hook: RecvHook) -> None:
        """Put ``hook`` in the slot of the next live ubatch (run at once if there is none)."""
        run = self._run
        if run.in_hook:
            raise HookMisuseError("a recv hook may not register another recv hook")
        if not callable(hook):
            raise TypeError(f"recv hook must be callable, got {type(hook).__name__}")
        target = run.next_live(self.id)
        if target is None:
            self._call_hook(hook, self.id)
            return
        if target._hook is not None:
            raise HookSlotOccupiedError(
                f"ubatch {self.id} registered a recv hook into ubatch {target.id}'s slot, which "
                f"still holds the unrun hook registered by ubatch {target._hook_registrant}"
            )
        target._hook = hook
        target._hook_registrant = self.id
        self.hook_pending_in = target
        if run.trace is not None:
            run.trace.record("hook_register", self.id, str(target.id))

    def maybe_run_recv_hook(self) -> None:
        """Run the hook in this ubatch's slot, if any."""
        if self._hook is not None:
            self.run_hook_in(self)

    def run_hook_in(self, runner: UBatchContext) -> None:
        """Run the hook held in this ubatch's slot, in ``runner``'s context (``runner`` is the
        running ubatch)."""
        hook, registrant = self._hook, self._hook_registrant
        self._hook = None
        self._hook_registrant = -1
        self._run.contexts[registrant].hook_pending_in = None
        runner._call_hook(hook, registrant)

    def _call_hook(self, hook: RecvHook, registrant: int) -> None:
        run = self._run
        if run.trace is not None:
            run.trace.record("hook_begin", self.id, str(registrant))
        run.in_hook = True
        try:
            hook()
        finally:
            run.in_hook = False
        if run.trace is not None:
            run.trace.record("hook_end", self.id)
