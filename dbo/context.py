"""The ubatch context: greenlet driver, stream switching, recv hooks.

``run_ubatches(fns)`` runs each callable as a greenlet on the calling thread. Only the driver
(the caller's greenlet) resumes a ubatch; a ubatch that calls :func:`dbo_yield` switches back
to the driver, which saves the thread state the ubatch left (current stream, grad, inference
and autocast modes), restores the next ubatch's and switches into it. The ``dbo_*`` functions
find the active run through one thread-local slot, so on a thread with no run they are cheap
no-ops and backend code runs unchanged without DBO. Semantics: ``DESIGN.md``, "The ubatch
context"; this is the only module that imports greenlet.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import greenlet
import torch

from dbo.errors import (
    HookMisuseError,
    HookSlotOccupiedError,
    NestedRunError,
    StreamStateError,
    UBatchCountError,
    UBatchError,
)
from dbo.streams import STREAM_POOL, StreamSet
from dbo.trace import Trace

__all__ = [
    "UBatchContext",
    "run_ubatches",
    "active_run",
    "dbo_enabled",
    "dbo_num_ubatches",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_token_offset",
    "dbo_current_context",
    "dbo_yield",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute_sync",
    "dbo_switch_to_compute_deferred",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_get_previous_event",
    "dbo_region",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
RecvHook = Callable[[], Any]

_DONE = object()
_FAILED = object()


def _noop() -> None:
    pass


class _ThreadState(threading.local):
    run: _Run | None = None
    # dbo_yield calls this without looking at `run`: the run's yield_current during a run,
    # a no-op outside one (one attribute load on the hottest path instead of three).
    yield_current: Callable[[], None] = staticmethod(_noop)


_tls = _ThreadState()


# ---- thread state kept per ubatch ---------------------------------------------------------

_AUTOCAST_DEVICES = ("cpu", "cuda")


_is_grad_enabled = torch._C.is_grad_enabled
_is_inference_mode_enabled = torch._C.is_inference_mode_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled


def _capture_modes() -> int | tuple:
    """Grad, inference and autocast state of this thread, cheap to compare.

    Without autocast (the common case) it is the int ``grad | inference << 1``; with autocast
    on for any device, the tuple ``(grad, inference, autocast)``.
    """
    if _is_any_autocast_enabled():
        autocast = tuple(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        ) + (torch.is_autocast_cache_enabled(),)
        return (_is_grad_enabled(), _is_inference_mode_enabled(), autocast)
    return _is_grad_enabled() | _is_inference_mode_enabled() << 1


def _expand_modes(modes: int | tuple) -> tuple:
    if isinstance(modes, int):
        return (bool(modes & 1), bool(modes & 2), None)
    return modes


def _autocast_state() -> tuple:
    """``((enabled, dtype) per device in _AUTOCAST_DEVICES) + (cache_enabled,)``."""
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
    ) + (torch.is_autocast_cache_enabled(),)


class _ModeRestorer:
    """Sets this thread's grad/inference/autocast state to a captured one, and puts the
    caller's back at the end of the run.

    Inference mode has no setter in torch, only a RAII guard (``torch._C._InferenceMode``) whose
    destruction restores the whole autograd state and dispatch-key set it saw when it was
    created. So at the start of the run, in the caller's state, the restorer creates one *base*
    guard with the caller's own inference flag (a no-op change) that saves exactly the caller's
    state. To change the inference flag at a switch, it drops the guard it holds (back to the
    caller's state) and creates a new one from there, which again saves the caller's state. It
    therefore holds exactly one guard at any time, always saving the caller's state, and
    dropping it in ``close`` restores the caller whatever guards the ubatches created and
    destroyed in between. Ubatches' own guards are created and destroyed while the thread holds
    that ubatch's state, so they restore it.

    The autocast dtypes are not part of that state: a ubatch whose autocast is off gets the
    caller's dtypes (known limit: a dtype set inside a disabled autocast block is not carried).
    """

    live_guards = 0  # guards held by restorers of this process (a test checks it returns to 0)

    __slots__ = ("caller", "caller_autocast", "caller_fw_mt", "guard")

    def __init__(self, caller: int | tuple) -> None:
        self.caller = _expand_modes(caller)
        self.caller_autocast = _autocast_state()
        self.caller_fw_mt = (torch._C._is_fwd_grad_enabled(), torch._C._is_multithreading_enabled())
        self.guard: Any = None
        self._new_guard(self.caller[1])

    def _new_guard(self, inference: bool) -> None:
        # The guard sets grad, forward-grad and multithreading to `not inference`: the caller's
        # own values are put back (for the base guard they are the state the guard changed).
        self.guard = torch._C._InferenceMode(inference)
        _ModeRestorer.live_guards += 1
        torch._C._set_grad_enabled(self.caller[0])
        fw, mt = self.caller_fw_mt
        if inference == self.caller[1]:
            torch._C._set_fwd_grad_enabled(fw)
            torch._C._set_multithreading_enabled(mt)

    def _drop_guard(self) -> None:
        if self.guard is not None:
            self.guard = None  # destroying it restores the caller's autograd state and key set
            _ModeRestorer.live_guards -= 1

    def apply(self, want: int | tuple, have: int | tuple) -> None:
        want, have = _expand_modes(want), _expand_modes(have)
        had_autocast = have[2]
        if want[1] != have[1]:
            self._drop_guard()
            self._new_guard(want[1])  # always one held, so that dropping it restores the caller
            # The guard swap reset the autocast keys (not the dtypes) to the caller's.
            have = _expand_modes(_capture_modes())
        if want[0] != have[0]:
            torch._C._set_grad_enabled(want[0])
        if want[2] != have[2] or want[2] != had_autocast:
            self._set_autocast(want[2])

    def _set_autocast(self, autocast: tuple | None) -> None:
        if autocast is None:  # off everywhere, with the caller's dtypes
            autocast = tuple((False, dtype) for _, dtype in self.caller_autocast[:-1]) \
                + (self.caller_autocast[-1],)
        for d, (enabled, dtype) in zip(_AUTOCAST_DEVICES, autocast[:-1], strict=True):
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(autocast[-1])

    def close(self) -> None:
        """Restore the caller's state (drop the guard, then grad and autocast)."""
        self._drop_guard()
        if torch.is_grad_enabled() != self.caller[0]:
            torch._C._set_grad_enabled(self.caller[0])
        if _autocast_state() != self.caller_autocast:
            self._set_autocast(self.caller_autocast)


# ---- the per-ubatch context ---------------------------------------------------------------


class UBatchContext:
    """State of one ubatch: id, streams, events, recv-hook slot and token offset.

    ``compute_stream`` is the caller's current stream when the run started; ``comm_stream`` is
    shared by all ubatches of the run. ``compute_done_event`` / ``comm_done_event`` are this
    ubatch's own events (recorded by the ``*_sync`` switches and the yield-and-switch calls).
    """

    __slots__ = (
        "id", "token_offset", "compute_stream", "comm_stream", "compute_done_event",
        "comm_done_event", "_run", "_streams", "_compute_key", "_comm_key", "_greenlet",
        "_modes", "_stream_key", "_hook", "_hook_registrant", "_hook_pending_in", "started",
        "live", "result",
    )

    def __init__(self, run: _Run, idx: int, fn: Callable[[], Any], token_offset: int,
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
        self._greenlet = greenlet.greenlet(self._body(fn), parent=run.driver)
        self._greenlet.gr_context = contextvars.copy_context()
        self._modes = run.caller_modes
        self._stream_key = run.compute_key
        self._hook: RecvHook | None = None
        self._hook_registrant = -1
        self._hook_pending_in: UBatchContext | None = None
        self.started = False
        self.live = True
        self.result: Any = None

    def _body(self, fn: Callable[[], Any]) -> Callable[[], tuple]:
        def body() -> tuple:
            self.started = True
            try:
                result = fn()
                self.maybe_run_recv_hook()
            except BaseException as exc:  # noqa: BLE001 - handed to the driver, which re-raises
                return (_FAILED, exc)
            return (_DONE, result)

        return body

    @property
    def current_stream(self) -> Any:
        """This ubatch's current stream (a ``torch.cuda.Stream`` or a ``LogicalStream``)."""
        key = self._streams.current() if self._run.current is self else self._stream_key
        return self._streams.stream(key)

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

    def switch_to_comm_sync(self) -> None:
        """Switch to the comm stream, which first waits for this ubatch's compute so far."""
        self._record(self.compute_done_event, self._compute_key, f"ub{self.id}.compute_done")
        self._set_stream(self._comm_key, "comm")
        self._wait(self._comm_key, self.compute_done_event, f"ub{self.id}.compute_done")

    def switch_to_compute_sync(self) -> None:
        """Switch to the compute stream, which first waits for this ubatch's comm so far."""
        self._record(self.comm_done_event, self._comm_key, f"ub{self.id}.comm_done")
        self._set_stream(self._compute_key, "compute")
        self._wait(self._compute_key, self.comm_done_event, f"ub{self.id}.comm_done")

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
        if self._streams.current() != self._compute_key:
            raise StreamStateError("dbo_yield_and_switch_from_compute_to_comm called while "
                                   "the current stream is not the compute stream")
        self._record(self.compute_done_event, self._compute_key, f"ub{self.id}.compute_done")
        self.yield_()
        self._set_stream(self._comm_key, "comm")
        self._wait(self._comm_key, self.compute_done_event, f"ub{self.id}.compute_done")

    def yield_and_switch_from_comm_to_compute(self) -> None:
        """Mark our comm done, yield, then continue on the compute stream after that comm."""
        if self._streams.current() != self._comm_key:
            raise StreamStateError("dbo_yield_and_switch_from_comm_to_compute called while "
                                   "the current stream is not the comm stream")
        self._record(self.comm_done_event, self._comm_key, f"ub{self.id}.comm_done")
        self.yield_()
        self._set_stream(self._compute_key, "compute")
        self._wait(self._compute_key, self.comm_done_event, f"ub{self.id}.comm_done")

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
        self._hook_pending_in = target
        if run.trace is not None:
            run.trace.record("hook_register", self.id, str(target.id))

    def maybe_run_recv_hook(self) -> None:
        """Run the hook in this ubatch's slot, if any."""
        if self._hook is not None:
            self._run_hook_in(self)

    def _run_hook_in(self, runner: UBatchContext) -> None:
        # Run the hook held in self's slot, in `runner`'s context (runner is current).
        hook, registrant = self._hook, self._hook_registrant
        self._hook = None
        self._hook_registrant = -1
        self._run.contexts[registrant]._hook_pending_in = None
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


# ---- the run and its driver ---------------------------------------------------------------


class _Run:
    """One ``run_ubatches`` call: the contexts and the driver loop."""

    __slots__ = ("streams", "trace", "driver", "compute_key", "comm_key", "current_stream",
                 "set_stream", "caller_modes", "modes", "in_hook", "live_count", "current",
                 "contexts", "yield_current")

    def __init__(self, fns: Sequence[Callable[[], Any]], streams: StreamSet, comm_stream: Any,
                 token_offsets: Sequence[int], trace: Trace | None):
        self.streams = streams
        self.trace = trace
        self.driver = greenlet.getcurrent()
        self.compute_key = streams.current()
        self.comm_key = streams.key(comm_stream if comm_stream is not None else streams.comm_stream)
        if self.comm_key == self.compute_key:
            raise ValueError("comm_stream must differ from the caller's current stream")
        self.current_stream = streams.current_getter()
        self.set_stream = streams.set_current
        self.caller_modes = _capture_modes()
        self.in_hook = False
        self.live_count = len(fns)
        self.current: UBatchContext | None = None
        self.contexts: list[UBatchContext] = []
        events = streams.events(len(fns))
        self.contexts = [UBatchContext(self, i, fn, token_offsets[i], events[i])
                         for i, fn in enumerate(fns)]
        # Last: it holds an inference-mode guard that only close() releases.
        self.modes = _ModeRestorer(self.caller_modes)
        self.yield_current = self._make_yield()

    def next_live(self, idx: int) -> UBatchContext | None:
        """The next live ubatch after ``idx`` in ring order, not ``idx`` itself."""
        ctxs = self.contexts
        n = len(ctxs)
        for step in range(1, n):
            c = ctxs[(idx + step) % n]
            if c.live:
                return c
        return None

    # Resuming a ubatch is centralised in `_enter`. A yield runs `switch_from` on the
    # yielding ubatch's stack and switches straight into the next ubatch; the driver greenlet
    # (the caller) is the parent of every ubatch, so a ubatch that returns or raises lands
    # back in `drive`, which picks the next one or unwinds. Bouncing every yield through the
    # driver would cost a second greenlet switch per yield (about 0.45 us each on the CPU
    # machine, where the whole switch budget is 1.5 us).

    def _enter(self, ctx: UBatchContext, stream: Any, modes: tuple) -> Any:
        """Restore ``ctx``'s thread state (the thread now holds ``stream``/``modes``) and
        resume it."""
        if ctx._modes != modes:
            self.modes.apply(ctx._modes, modes)
        if ctx._stream_key != stream:
            self.set_stream(ctx._stream_key)
        self.current = ctx
        if self.trace is not None:
            self.trace.record("resume", ctx.id)
        return ctx._greenlet.switch()

    def _make_yield(self) -> Callable[[], None]:
        """Build this run's ``yield_current``: suspend the running ubatch and resume the next
        live one in ring order.

        The hot path of every switch, so it is a closure over locals (no attribute or global
        lookups it can avoid) and inlines the state capture of ``_capture_modes``.
        """
        run = self
        ctxs = self.contexts
        n = len(ctxs)
        current_stream = self.current_stream
        set_stream = self.set_stream
        apply_modes = self.modes.apply
        is_grad, is_inference, any_autocast = (
            _is_grad_enabled, _is_inference_mode_enabled, _is_any_autocast_enabled)
        capture = _capture_modes
        switches = [c._greenlet.switch for c in ctxs]

        def yield_current() -> None:
            if run.in_hook:
                raise HookMisuseError("a recv hook may not yield (dbo_yield called inside a hook)")
            if run.live_count < 2:
                return
            ctx = run.current
            stream = ctx._stream_key = current_stream()
            modes = ctx._modes = capture() if any_autocast() else is_grad() | is_inference() << 1
            trace = run.trace
            if trace is not None:
                trace.record("suspend", ctx.id)
            i = ctx.id + 1
            if i == n:
                i = 0
            nxt = ctxs[i]
            while not nxt.live:
                i += 1
                if i == n:
                    i = 0
                nxt = ctxs[i]
            if nxt._modes != modes:
                apply_modes(nxt._modes, modes)
            if nxt._stream_key != stream:
                set_stream(nxt._stream_key)
            run.current = nxt
            if trace is not None:
                trace.record("resume", nxt.id)
            switches[i]()
            # resumed: a hook we registered that its slot's owner has not run yet runs now
            pending = ctx._hook_pending_in
            if pending is not None:
                pending._run_hook_in(ctx)

        return yield_current

    def drive(self) -> list[Any]:
        """Run until every ubatch has returned; raise after unwinding if one failed."""
        ctxs = self.contexts
        n = len(ctxs)
        trace = self.trace
        ctx = ctxs[0]
        stream, modes = self.compute_key, self.caller_modes
        while True:
            status, value = self._enter(ctx, stream, modes)
            done = self.current  # the ubatch whose callable just returned or raised
            stream = done._stream_key = self.current_stream()
            modes = done._modes = _capture_modes()
            done.live = False
            self.live_count -= 1
            if status is _FAILED:
                if trace is not None:
                    trace.record("fail", done.id, type(value).__name__)
                self.unwind(done.id)
                if isinstance(value, (KeyboardInterrupt, SystemExit)):
                    raise value
                raise UBatchError(done.id, value) from value
            done.result = value
            if trace is not None:
                trace.record("finish", done.id)
            if self.live_count == 0:
                return [c.result for c in ctxs]
            i = done.id
            while True:
                i += 1
                if i == n:
                    i = 0
                if ctxs[i].live:
                    ctx = ctxs[i]
                    break

    def unwind(self, failed: int) -> None:
        """Throw GreenletExit into every started, unfinished ubatch, in ring order from
        ``failed``; unstarted ones never start; pending hooks are dropped."""
        for c in self.contexts:
            c._hook = None
            c._hook_pending_in = None
        n = len(self.contexts)
        victims = [self.contexts[(failed + k) % n] for k in range(1, n)]
        for c in victims:
            c.live = False
        self.live_count = 0
        for c in victims:
            if not c.started or c._greenlet.dead:
                continue
            # While it unwinds, the victim is the only live ubatch: its yields return at once
            # and hooks it registers run at once, so its finally blocks cannot hang.
            c.live = True
            self.live_count = 1
            self.current = c
            have = _capture_modes()
            if have != c._modes:
                self.modes.apply(c._modes, have)
            self.streams.set_current(c._stream_key)
            if self.trace is not None:
                self.trace.record("unwind", c.id)
            try:
                ret = c._greenlet.throw(greenlet.GreenletExit)
            except BaseException:  # noqa: BLE001 - unwinding must reach every ubatch
                logger.exception("ubatch %d raised while being unwound", c.id)
            else:
                if isinstance(ret, tuple) and ret and ret[0] is _FAILED and \
                        not isinstance(ret[1], greenlet.GreenletExit):
                    logger.error("ubatch %d raised while being unwound", c.id, exc_info=ret[1])
            if self.trace is not None:
                self.trace.record("unwound", c.id)
            c.live = False
            self.live_count = 0

    def close(self) -> None:
        """Join the comm stream into the caller's stream and restore the caller's state."""
        streams = self.streams
        start_ev, end_ev = streams.join_events()
        del start_ev
        streams.record(end_ev, streams.stream(self.comm_key))
        streams.set_current(self.compute_key)
        streams.wait(streams.stream(self.compute_key), end_ev)
        self.modes.close()
        self.current = None


def run_ubatches(
    fns: Sequence[Callable[[], T]],
    *,
    comm_stream: Any = None,
    token_offsets: Sequence[int] | None = None,
    trace: Trace | None = None,
    device: str | torch.device | None = None,
) -> list[T]:
    """Run ``fns`` (N >= 2 zero-argument callables) as interleaved ubatches on this thread.

    Returns their results in ubatch order. Ubatch 0 starts; each ``dbo_yield`` resumes the next
    live ubatch in ring order.

    Args:
        fns: the ubatch bodies.
        comm_stream: the stream for communication (default: one high-priority stream per
            device, created once and reused). A ``torch.cuda.Stream`` on CUDA, a
            :class:`dbo.streams.LogicalStream` on the CPU stand-in.
        token_offsets: each ubatch's first row in the parent batch (default all 0).
        trace: a :class:`dbo.trace.Trace` to record into.
        device: ``"cuda"`` (the current CUDA device) or ``"cpu"`` (the stand-in). Default:
            the device of ``comm_stream`` if given, else CUDA when available, else CPU.

    Raises:
        UBatchCountError: fewer than two ubatches, or ``token_offsets`` of another length.
        NestedRunError: a run is already active on this thread.
        UBatchError: a ubatch raised; ``__cause__`` is its exception. ``KeyboardInterrupt`` and
            ``SystemExit`` propagate as they are. Either way every other started ubatch was
            unwound first and no state is left behind.
    """
    if _tls.run is not None:
        raise NestedRunError("run_ubatches called inside a running ubatch (nested runs are not "
                             "supported)")
    fns = list(fns)
    if len(fns) < 2:
        raise UBatchCountError(f"run_ubatches needs at least 2 ubatches, got {len(fns)}")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"fns[{i}] is not callable: {fn!r}")
    if token_offsets is None:
        offsets = [0] * len(fns)
    else:
        offsets = [int(o) for o in token_offsets]
        if len(offsets) != len(fns):
            raise UBatchCountError(f"token_offsets has {len(offsets)} entries for {len(fns)} "
                                   "ubatches")
    if device is None:
        if comm_stream is not None and isinstance(comm_stream, torch.cuda.Stream):
            device = comm_stream.device
        elif comm_stream is None and torch.cuda.is_available():
            device = "cuda"
        else:
            device = "cpu"
    streams = STREAM_POOL.get(device)
    run = _Run(fns, streams, comm_stream, offsets, trace)
    _tls.run = run
    _tls.yield_current = run.yield_current
    try:
        if trace is not None:
            trace.begin_run(len(fns), streams.device.type == "cuda")
        start_ev, _ = streams.join_events()
        streams.record(start_ev, streams.stream(run.compute_key))
        streams.wait(streams.stream(run.comm_key), start_ev)
        try:
            return run.drive()
        except BaseException:
            if run.live_count:  # the driver itself failed: unwind everything still suspended
                run.unwind(run.current.id if run.current is not None else 0)
            raise
    finally:
        _tls.run = None
        _tls.yield_current = _noop
        run.close()
        if trace is not None:
            trace.end_run()


def active_run() -> Any:
    """The run active on this thread, or None (for tests that check nothing is left behind)."""
    return _tls.run


# ---- the dbo_* functions ------------------------------------------------------------------


def dbo_enabled() -> bool:
    """True inside a ``run_ubatches`` on this thread."""
    return _tls.run is not None


def dbo_num_ubatches() -> int:
    """Number of ubatches of the active run (1 outside a run)."""
    run = _tls.run
    return 1 if run is None else len(run.contexts)


def dbo_current_context() -> UBatchContext | None:
    """The running ubatch's context, or None outside a run."""
    run = _tls.run
    return None if run is None else run.current


def dbo_current_ubatch_id() -> int:
    """Index of the running ubatch (0 outside a run)."""
    run = _tls.run
    return 0 if run is None else run.current.id


def dbo_current_ubatch_token_offset() -> int:
    """First row of the running ubatch in the parent batch (0 outside a run)."""
    run = _tls.run
    return 0 if run is None else run.current.token_offset


def dbo_yield() -> None:
    """Resume the next live ubatch in ring order; return when this one is resumed."""
    _tls.yield_current()


def dbo_maybe_run_recv_hook() -> None:
    """Run the recv hook that another ubatch registered into this ubatch's slot, if any."""
    run = _tls.run
    if run is not None:
        run.current.maybe_run_recv_hook()


def dbo_register_recv_hook(hook: RecvHook) -> None:
    """Hand ``hook`` to the next live ubatch; it runs before this ubatch continues.

    Outside a run the hook runs at once.
    """
    run = _tls.run
    if run is None:
        hook()
    else:
        run.current.register_recv_hook(hook)


def dbo_switch_to_comm() -> None:
    run = _tls.run
    if run is not None:
        run.current.switch_to_comm()


def dbo_switch_to_compute() -> None:
    run = _tls.run
    if run is not None:
        run.current.switch_to_compute()


def dbo_switch_to_comm_sync() -> None:
    run = _tls.run
    if run is not None:
        run.current.switch_to_comm_sync()


def dbo_switch_to_compute_sync() -> None:
    run = _tls.run
    if run is not None:
        run.current.switch_to_compute_sync()


def dbo_switch_to_compute_deferred() -> Callable[[], None]:
    """Switch to the compute stream now and return ``wait()``, which makes it wait for this
    ubatch's comm so far (see :meth:`UBatchContext.switch_to_compute_deferred`). Outside a run
    returns a no-op."""
    run = _tls.run
    if run is None:
        return _noop
    return run.current.switch_to_compute_deferred()


def dbo_yield_and_switch_from_compute_to_comm() -> None:
    run = _tls.run
    if run is not None:
        run.current.yield_and_switch_from_compute_to_comm()


def dbo_yield_and_switch_from_comm_to_compute() -> None:
    run = _tls.run
    if run is not None:
        run.current.yield_and_switch_from_comm_to_compute()


def dbo_get_previous_event(func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Call ``func(*args, **kwargs)`` with the compute stream current and return its result.

    With DeepEP's ``Buffer.capture`` this gives the event covering this ubatch's compute work
    so far. Outside a run returns None without calling ``func``.
    """
    run = _tls.run
    if run is None:
        return None
    streams = run.streams
    prev = streams.current()
    streams.set_current(run.compute_key)
    try:
        return func(*args, **kwargs)
    finally:
        streams.set_current(prev)


@contextmanager
def dbo_region(name: str) -> Iterator[None]:
    """Mark a named region of the running ubatch in the run's trace (and NVTX on CUDA).

    A no-op outside a run or when the run has no trace. Regions may span yields.
    """
    run = _tls.run
    trace = None if run is None else run.trace
    if trace is None:
        yield
        return
    ub = run.current.id
    trace.region_begin(ub, name)
    try:
        yield
    finally:
        trace.region_end(ub, name)
