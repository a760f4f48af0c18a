"""The greenlet driver behind :func:`dbo.ubatch.context.run_ubatches`: one loop that starts, resumes,
finishes and unwinds the ubatches of a run on the calling thread.

Two rules, after SQLAlchemy's greenlet bridge and gevent's hub:

* Only this module resumes a ubatch, through :meth:`Run._enter` (the loop in
  :meth:`Run.drive`) or the run's ``yield_current`` (built by :meth:`Run.make_yield`), and both
  save the thread state the last ubatch left (current stream, grad, inference and autocast
  modes, torch's mode stacks) and restore the next one's before the switch. The mode stacks
  are off the thread while grad and inference modes change (the inference-mode guard restores
  the dispatch-key set it was created with, which a dispatch mode's stack would otherwise be
  out of step with), and whenever the driver itself runs. A yield switches straight from the
  yielding ubatch to the next one instead of bouncing through the driver greenlet: that would
  cost a second greenlet switch per yield (about 0.45 us each on the CPU machine, where the
  whole switch budget is 1.5 us). The driver greenlet (the caller) is the parent of every
  ubatch, so a ubatch that returns or raises lands back in :meth:`Run.drive`.
* A failure is forwarded into every other started ubatch with ``throw(GreenletExit)``
  (:meth:`Run.unwind`), so that their ``finally`` blocks run before ``run_ubatches`` raises.

The ``dbo_*`` functions find the active run through one thread-local slot, :data:`tls`.

A seam for the contract tests: ``tests/test_context_broken.py`` proves that the contract check
(:mod:`dbo.testing.programs`) can fail, by running it against deliberately broken drivers. To
build one it may replace (with ``monkeypatch``, undone after the test) these names and no others:
:meth:`Run.make_yield` (a stand-in yield with one step left out), :meth:`Run.unwind` (no
unwinding), and :meth:`dbo.ubatch.state.UBatchContext.body` and ``UBatchContext.__init__`` (a
ubatch that skips its last hook, or starts outside a copy of the caller's ``contextvars``). A
stand-in reads and writes the same run and context attributes as the code it replaces, and
returns :data:`dbo.ubatch.state.DONE` / :data:`~dbo.ubatch.state.FAILED` pairs as the real body
does; it may call :func:`dbo.ubatch.modes.capture_modes`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import greenlet

from dbo.errors import HookMisuseError, UBatchError
from dbo.ubatch.mode_stacks import (
    ModeStacks,
    len_dispatch_stack,
    len_function_stack,
    saved_hooks_disabled,
    top_saved_hooks,
)
from dbo.ubatch.modes import (
    ModeRestorer,
    capture_modes,
    is_any_autocast_enabled,
    is_grad_enabled,
    is_inference_mode_enabled,
)
from dbo.ubatch.state import FAILED, UBatchContext
from dbo.ubatch.streams import StreamSet
from dbo.ubatch.trace import Trace

__all__ = ["Run", "noop", "run_to_completion", "tls"]

# Named after the public module: users and tests configure the "dbo.ubatch.context" logger.
logger = logging.getLogger("dbo.ubatch.context")


def noop() -> None:
    pass


class _ThreadState(threading.local):
    run: Run | None = None
    # dbo_yield calls this without looking at `run`: the run's yield_current during a run,
    # a no-op outside one (one attribute load on the hottest path instead of three).
    yield_current: Callable[[], None] = staticmethod(noop)


tls = _ThreadState()


class Run:
    """One ``run_ubatches`` call: the contexts and the driver loop."""

    __slots__ = ("streams", "trace", "driver", "compute_key", "comm_key", "current_stream",
                 "set_stream", "caller_modes", "modes", "mode_stacks", "in_hook", "live_count", "current",
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
        self.caller_modes = capture_modes()
        self.in_hook = False
        self.live_count = len(fns)
        self.current: UBatchContext | None = None
        self.contexts: list[UBatchContext] = []
        events = streams.events(len(fns))
        self.contexts = [UBatchContext(self, i, fn, token_offsets[i], events[i])
                         for i, fn in enumerate(fns)]
        # Last: they take the caller's mode stacks off the thread (each ubatch starts with them)
        # and hold an inference-mode guard, created with no stacks on, that only close() releases.
        self.mode_stacks = ModeStacks()
        try:
            self.modes = ModeRestorer(self.caller_modes)
        except BaseException:
            self.mode_stacks.close()
            raise
        for c in self.contexts:
            c.torch_stacks = self.mode_stacks.caller
        self.yield_current = self.make_yield()

    def next_live(self, idx: int) -> UBatchContext | None:
        """The next live ubatch after ``idx`` in ring order, not ``idx`` itself."""
        ctxs = self.contexts
        n = len(ctxs)
        for step in range(1, n):
            c = ctxs[(idx + step) % n]
            if c.live:
                return c
        return None

    # The two places that resume a ubatch: `_enter` (from the driver loop) and the run's
    # `yield_current` (from the yielding ubatch's stack; see the module docstring for why).

    def _enter(self, ctx: UBatchContext, stream: Any, modes: int | tuple) -> Any:
        """Restore ``ctx``'s thread state (the thread now holds ``stream``/``modes`` and no mode
        stacks) and resume it."""
        if ctx.modes != modes:
            self.modes.apply(ctx.modes, modes)
        stacks = ctx.torch_stacks
        if stacks is not None:
            ctx.torch_stacks = None
            self.mode_stacks.put(stacks)
        if ctx.stream_key != stream:
            self.set_stream(ctx.stream_key)
        self.current = ctx
        if self.trace is not None:
            self.trace.record("resume", ctx.id)
        return ctx.resume()

    def make_yield(self) -> Callable[[], None]:
        """Build this run's ``yield_current``: suspend the running ubatch and resume the next
        live one in ring order.

        The hot path of every switch, so it is a closure over locals (no attribute or global
        lookups it can avoid) and inlines the state capture of ``capture_modes``.
        """
        run = self
        ctxs = self.contexts
        n = len(ctxs)
        current_stream = self.current_stream
        set_stream = self.set_stream
        apply_modes = self.modes.apply
        take_stacks, put_stacks = self.mode_stacks.take, self.mode_stacks.put
        function_modes, dispatch_modes, saved_hooks, hooks_off = (
            len_function_stack, len_dispatch_stack, top_saved_hooks, saved_hooks_disabled)
        is_grad, is_inference, any_autocast = (
            is_grad_enabled, is_inference_mode_enabled, is_any_autocast_enabled)
        capture = capture_modes
        switches = [c.resumer() for c in ctxs]

        def yield_current() -> None:
            if run.in_hook:
                raise HookMisuseError("a recv hook may not yield (dbo_yield called inside a hook)")
            if run.live_count < 2:
                return
            ctx = run.current
            stream = ctx.stream_key = current_stream()
            modes = ctx.modes = capture() if any_autocast() else is_grad() | is_inference() << 1
            if function_modes() or dispatch_modes() or saved_hooks(True) is not None \
                    or hooks_off() is not None:
                ctx.torch_stacks = take_stacks()
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
            if nxt.modes != modes:
                apply_modes(nxt.modes, modes)
            stacks = nxt.torch_stacks
            if stacks is not None:
                nxt.torch_stacks = None
                put_stacks(stacks)
            if nxt.stream_key != stream:
                set_stream(nxt.stream_key)
            run.current = nxt
            if trace is not None:
                trace.record("resume", nxt.id)
            switches[i]()
            # resumed: a hook we registered that its slot's owner has not run yet runs now
            pending = ctx.hook_pending_in
            if pending is not None:
                pending.run_hook_in(ctx)

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
            stream = done.stream_key = self.current_stream()
            modes = done.modes = capture_modes()
            self.mode_stacks.clear()
            done.live = False
            self.live_count -= 1
            if status is FAILED:
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
            c.drop_hooks()
        n = len(self.contexts)
        victims = [self.contexts[(failed + k) % n] for k in range(1, n)]
        for c in victims:
            c.live = False
        self.live_count = 0
        for c in victims:
            if not c.started or c.finished:
                continue
            # While it unwinds, the victim is the only live ubatch: its yields return at once
            # and hooks it registers run at once, so its finally blocks cannot hang.
            c.live = True
            self.live_count = 1
            self.current = c
            self.mode_stacks.clear()
            have = capture_modes()
            if have != c.modes:
                self.modes.apply(c.modes, have)
            stacks = c.torch_stacks
            if stacks is not None:
                c.torch_stacks = None
                self.mode_stacks.put(stacks)
            self.streams.set_current(c.stream_key)
            if self.trace is not None:
                self.trace.record("unwind", c.id)
            try:
                ret = c.throw_exit()
            except BaseException:  # noqa: BLE001 - unwinding must reach every ubatch
                logger.exception("ubatch %d raised while being unwound", c.id)
            else:
                if isinstance(ret, tuple) and ret and ret[0] is FAILED and \
                        not isinstance(ret[1], greenlet.GreenletExit):
                    logger.error("ubatch %d raised while being unwound", c.id, exc_info=ret[1])
            if self.trace is not None:
                self.trace.record("unwound", c.id)
            c.live = False
            self.live_count = 0
            self.mode_stacks.clear()

    def close(self) -> None:
        """Join the comm stream into the caller's stream and restore the caller's state."""
        streams = self.streams
        start_ev, end_ev = streams.join_events()
        del start_ev
        streams.record(end_ev, streams.stream(self.comm_key))
        streams.set_current(self.compute_key)
        streams.wait(streams.stream(self.compute_key), end_ev)
        self.mode_stacks.clear()
        self.modes.close()
        self.mode_stacks.close()
        self.current = None


def run_to_completion(fns: Sequence[Callable[[], Any]], streams: StreamSet, comm_stream: Any,
                      token_offsets: Sequence[int], trace: Trace | None) -> list[Any]:
    """Run ``fns`` as ubatches on this thread (arguments checked by ``run_ubatches``), with the
    comm stream joined to the caller's stream at both ends; return their results in order."""
    run = Run(fns, streams, comm_stream, token_offsets, trace)
    tls.run = run
    tls.yield_current = run.yield_current
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
        tls.run = None
        tls.yield_current = noop
        run.close()
        if trace is not None:
            trace.end_run()
