"""An executable model of the ubatch context contract, independent of the implementation.

It reads DESIGN.md, "The ubatch context: semantics", as a specification and predicts, for
per-ubatch programs, the exact log a correct runtime produces: the interleaving, which ubatch
runs each recv hook and when, what each ubatch observes (its id, current stream, grad and
autocast mode, contextvar) after every step, which ``finally`` blocks run in which order on a
failure, which ubatches never start, and how ``run_ubatches`` ends. It imports nothing from
the runtime: ubatches are plain Python generators here, and a ``yield`` of the generator is the
point where the runtime switches greenlets. :mod:`dbo.testing.programs` runs the same programs
on the real runtime and logs the same events, so the two logs compare line by line.

The programs and the log are data, defined in :mod:`dbo.testing.ops` (which imports nothing from
``dbo``); they stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo.testing.ops import (
    GREENLET_EXIT,
    HOOK_MISUSE,
    SLOT_OCCUPIED,
    STREAM_STATE,
    Case,
    Event,
    Op,
    Outcome,
    Prediction,
    Program,
    describe_raise,
    op_name,
)

__all__ = ["predict", "OnlineModel"]


# ---- the simulation -----------------------------------------------------------------------


class _Raised(Exception):
    """An exception inside a simulated ubatch; ``desc`` is how the logs describe it."""

    def __init__(self, desc: str, interrupt: bool = False):
        super().__init__(desc)
        self.desc = desc
        self.interrupt = interrupt


@dataclass
class _Ub:
    stream: str
    grad: bool
    autocast: bool
    var: str
    live: bool = True
    started: bool = False
    done: bool = False
    slot: tuple[str, str, int] | None = None  # (hook name, hook kind, registrant)
    pending_in: int | None = None  # the slot that holds this ubatch's unrun hook
    result: Any = None


_NEED = "need"
_SWITCH = "switch"


@dataclass
class _Sim:
    """The contract as a state machine over generator-ubatches.

    ``source(ub, index)`` gives a ubatch's next body op: an :class:`Op`, None (end of the body)
    or ``_NEED`` (ask the caller: the simulation pauses until :meth:`feed`).
    """

    n: int
    finals: Sequence[tuple[Op, ...]]
    case: Case
    source: Callable[[int, int], Any]
    events: list[Event] = field(default_factory=list)
    outcome: Outcome | None = None

    def __post_init__(self) -> None:
        c = self.case
        self.ubs = [_Ub("compute", c.caller_grad, c.caller_autocast, c.caller_var) for _ in range(self.n)]
        self.gens = [self._ubatch(u) for u in range(self.n)]
        self.in_hook = False
        self.current = 0
        self.waiting: int | None = None  # the ubatch that asked for an op (online mode)
        self.unwind_logged: list[int] = []
        self.schedule: list[tuple[str, int]] = [("resume", 0)]  # ubatch 0 starts

    # ---- observation and ring order ----

    def _obs(self, u: int) -> tuple:
        s = self.ubs[u]
        return (u, s.stream, s.grad, s.autocast, s.var)

    def _emit(self, kind: str, u: int, name: str = "", detail: str = "", obs_of: int | None = None) -> None:
        self.events.append(Event(kind, u, name, detail, self._obs(u if obs_of is None else obs_of)))

    def _next_live(self, u: int) -> int | None:
        for step in range(1, self.n):
            v = (u + step) % self.n
            if self.ubs[v].live:
                return v
        return None

    def _live_count(self) -> int:
        return sum(s.live for s in self.ubs)

    # ---- hooks ----

    def _call_hook(self, name: str, kind: str, runner: int) -> None:
        """A hook body: it logs (in the runner's context), then does what its kind says."""
        self.events.append(Event("hook", runner, name, "", self._obs(runner)))
        self.in_hook = True
        try:
            if kind == "!":
                raise _Raised(describe_raise("X", "h" + name))
            if kind in ("y", "r"):  # a hook may neither yield nor register
                raise _Raised(HOOK_MISUSE)
        finally:
            self.in_hook = False

    def _run_slot(self, owner: int, runner: int) -> None:
        name, kind, registrant = self.ubs[owner].slot
        self.ubs[owner].slot = None
        self.ubs[registrant].pending_in = None
        self._call_hook(name, kind, runner)

    def _register(self, u: int, name: str, kind: str) -> None:
        target = self._next_live(u)
        if target is None:  # no other live ubatch: the hook runs at once
            self._call_hook(name, kind, u)
        elif self.ubs[target].slot is not None:
            raise _Raised(SLOT_OCCUPIED)
        else:
            self.ubs[target].slot = (name, kind, u)
            self.ubs[u].pending_in = target

    # ---- ops ----

    def _yield(self, u: int) -> Iterator[Any]:
        if self.in_hook:
            raise _Raised(HOOK_MISUSE)
        if self._live_count() < 2:
            return
        yield (_SWITCH, self._next_live(u))
        # Resumed. A hook this ubatch registered that is still pending runs first, here.
        owner = self.ubs[u].pending_in
        if owner is not None:
            self._run_slot(owner, u)

    def _exec(self, u: int, op: Op, name: str) -> Iterator[Any]:
        s = self.ubs[u]
        k = op.kind
        if k == "Y":
            yield from self._yield(u)
        elif k in ("C", "CS"):
            s.stream = "comm"
        elif k in ("K", "KS"):
            s.stream = "compute"
        elif k in ("YC", "YK"):
            frm, to = ("compute", "comm") if k == "YC" else ("comm", "compute")
            if s.stream != frm:
                raise _Raised(STREAM_STATE)
            yield from self._yield(u)
            s.stream = to
        elif k == "R":
            self._register(u, name, op.arg)
        elif k == "H":
            if s.slot is not None:
                self._run_slot(u, u)
        elif k == "G":
            s.grad = op.arg == "1"
        elif k == "A":
            s.autocast = op.arg == "1"
        elif k == "V":
            s.var = name
        elif k in ("X", "I"):
            raise _Raised(describe_raise(k, name), interrupt=k == "I")
        else:  # pragma: no cover - END never reaches _exec
            raise AssertionError(k)

    def _ops(self, u: int, section: str, ops: Sequence[Op]) -> Iterator[Any]:
        for i, op in enumerate(ops):
            name = op_name(u, section, i)
            yield from self._exec(u, op, name)
            self._emit("op", u, name, str(op))

    def _ubatch(self, u: int) -> Iterator[Any]:
        s = self.ubs[u]
        s.started = True
        self._emit("start", u)
        try:
            i = 0
            while True:
                op = self.source(u, i)
                if op is _NEED:
                    op = yield (_NEED, u)
                if op is None or op.kind == "END":
                    break
                name = op_name(u, "b", i)
                yield from self._exec(u, op, name)
                self._emit("op", u, name, str(op))
                i += 1
        except _Raised as exc:
            self._emit("finally", u, "", exc.desc)
            yield from self._ops(u, "f", self.finals[u])
            raise
        self._emit("finally", u, "", "-")
        yield from self._ops(u, "f", self.finals[u])
        self._emit("return", u)
        # After the callable returns, the ubatch runs the hook left in its slot.
        if s.slot is not None:
            self._run_slot(u, u)
        return f"r{u}"

    # ---- the driver ----

    def advance(self, value: Any = None) -> None:
        """Run until the simulation needs an op (``waiting`` is set) or the run ended."""
        cur = self.current
        while True:
            self.current = cur
            try:
                msg = self.gens[cur].send(value)
            except StopIteration as stop:
                s = self.ubs[cur]
                s.live, s.done, s.result = False, True, stop.value
                nxt = self._next_live(cur)
                if nxt is None:
                    self.outcome = Outcome(None, tuple(x.result for x in self.ubs),
                                           tuple(x.started for x in self.ubs))
                    return
                cur, value = nxt, None
                self.schedule.append(("resume", cur))
                continue
            except _Raised as exc:
                self._fail(cur, exc)
                return
            value = None
            if msg[0] == _SWITCH:
                cur = msg[1]
                self.schedule.append(("resume", cur))
            else:
                self.waiting = cur
                return

    def _fail(self, failed: int, exc: _Raised) -> None:
        s = self.ubs[failed]
        s.live, s.done = False, True
        for x in self.ubs:
            x.slot, x.pending_in = None, None  # pending hooks are dropped
        victims = [(failed + k) % self.n for k in range(1, self.n)]
        for v in victims:
            self.ubs[v].live = False
        for v in victims:
            x = self.ubs[v]
            if not x.started or x.done:
                continue  # never started: never starts; finished: nothing to unwind
            x.live = True  # the only live ubatch: its yields return at once
            self.current = v
            self.schedule.append(("unwind", v))
            try:
                msg = self.gens[v].throw(_Raised(GREENLET_EXIT))
            except _Raised as e:
                if e.desc != GREENLET_EXIT:
                    self.unwind_logged.append(v)
            except StopIteration:  # pragma: no cover - the programs always re-raise
                pass
            else:  # pragma: no cover - a lone live ubatch never switches away
                raise AssertionError(f"ub{v} switched away while being unwound: {msg}")
            x.live, x.done = False, True
        error = f"KeyboardInterrupt({exc.desc})" if exc.interrupt else f"UBatchError({failed}, {exc.desc})"
        self.outcome = Outcome(error, None, tuple(x.started for x in self.ubs), tuple(self.unwind_logged))


def predict(case: Case) -> Prediction:
    """The log and outcome that ``run_ubatches`` must produce for ``case``."""
    progs = case.programs
    if len(progs) < 2:
        raise ValueError("a case needs at least 2 ubatches")

    def source(u: int, i: int) -> Op | None:
        body = progs[u].body
        return body[i] if i < len(body) else None

    sim = _Sim(len(progs), [p.final for p in progs], case, source)
    sim.advance()
    assert sim.outcome is not None, "the model paused without an op source"
    return Prediction(tuple(sim.events), sim.outcome, tuple(sim.schedule))


class OnlineModel:
    """The model fed one op at a time, for a state machine that drives a real run in step.

    After construction and after each :meth:`feed`, either :attr:`waiting` names the ubatch
    that now runs and wants its next op, or :attr:`outcome` is set (the run ended).
    ``END`` as an op makes the waiting ubatch's body return.
    """

    def __init__(self, n: int, finals: Sequence[tuple[Op, ...]] | None = None, *,
                 caller_grad: bool = True, caller_autocast: bool = False, caller_var: str = "caller"):
        finals = list(finals) if finals is not None else [()] * n
        case = Case(tuple(Program((), f) for f in finals), caller_grad, caller_autocast, caller_var)
        self._sim = _Sim(n, finals, case, lambda u, i: _NEED)
        self._sim.advance()

    @property
    def events(self) -> list[Event]:
        return self._sim.events

    @property
    def waiting(self) -> int | None:
        return None if self._sim.outcome is not None else self._sim.waiting

    @property
    def outcome(self) -> Outcome | None:
        return self._sim.outcome

    def feed(self, op: Op) -> None:
        if self.waiting is None:
            raise RuntimeError("the run has ended")
        self._sim.waiting = None
        self._sim.advance(op)
