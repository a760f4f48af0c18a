"""An executable model of the ubatch context contract, independent of the implementation.

It reads DESIGN.md, "The ubatch context: semantics", as a specification and predicts, for
per-ubatch programs, the exact log a correct runtime produces: the interleaving, which ubatch
runs each recv hook and when, what each ubatch observes (its id, current stream, grad and
autocast mode, contextvar) after every step, which ``finally`` blocks run in which order on a
failure, which ubatches never start, and how ``run_ubatches`` ends. It imports nothing from
``dbo``: ubatches are plain Python generators here, and a ``yield`` of the generator is the
point where the runtime switches greenlets. :mod:`dbo.testing.programs` runs the same programs
on the real runtime and logs the same events, so the two logs compare line by line.

A program is data (STYLE.md: a schedule is data). Each :class:`Op` has a compact string form
that :meth:`Op.parse` reads back; a :class:`Case` prints as one line per ubatch, body and
``finally`` ops separated by ``|``::

    ub0: Y R Y | Y
    ub1: CS H KS

Ops (``<u><b|f><k>`` names the op: ubatch, body or finally, index; it tags hooks, raises and
contextvar values so that every one is unique):

====  ======================================================================================
Y     ``dbo_yield()``
C K   ``dbo_switch_to_comm()`` / ``dbo_switch_to_compute()``
CS KS ``dbo_switch_to_comm_sync()`` / ``dbo_switch_to_compute_sync()``
YC    ``dbo_yield_and_switch_from_compute_to_comm()`` (StreamStateError unless on compute)
YK    ``dbo_yield_and_switch_from_comm_to_compute()`` (StreamStateError unless on comm)
R     register a recv hook that logs; ``R!`` one that logs then raises; ``Ry`` one that logs
      then calls ``dbo_yield`` and ``Rr`` one that logs then registers a hook (both misuse)
H     ``dbo_maybe_run_recv_hook()``
G0 G1 grad mode off / on (``torch.set_grad_enabled``)
A0 A1 CPU autocast off / on (``torch.set_autocast_enabled("cpu", ...)``)
V     set the test contextvar to this op's name
X     raise ``ProgramError(name)``;  I: raise ``KeyboardInterrupt(name)``
END   return from the body (only used when a program is fed one op at a time)
====  ======================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OP_KINDS",
    "HOOK_KINDS",
    "Op",
    "Program",
    "Case",
    "Event",
    "Outcome",
    "Prediction",
    "predict",
    "OnlineModel",
    "op_name",
    "describe_raise",
]

#: op kinds, in their compact string form
OP_KINDS = ("Y", "C", "K", "CS", "KS", "YC", "YK", "R", "H", "G", "A", "V", "X", "I", "END")
#: what a registered hook does after logging: "" nothing, "!" raise, "y" yield, "r" register
HOOK_KINDS = ("", "!", "y", "r")
#: ops that may switch to another ubatch
SWITCHING = frozenset({"Y", "YC", "YK"})

# The descriptions the logs use for exceptions, shared by the model and the interpreter.
GREENLET_EXIT = "GreenletExit"
HOOK_MISUSE = "HookMisuseError"
SLOT_OCCUPIED = "HookSlotOccupiedError"
STREAM_STATE = "StreamStateError"


def op_name(ub: int, section: str, index: int) -> str:
    """Name of the op at ``index`` of ubatch ``ub``'s body (``section="b"``) or finally ("f")."""
    return f"{ub}{section}{index}"


def describe_raise(kind: str, name: str) -> str:
    """Log description of the exception an ``X``/``I`` op or a ``R!`` hook raises."""
    return ("kbd:" if kind == "I" else "err:") + name


@dataclass(frozen=True)
class Op:
    """One step of a ubatch program. ``arg`` is the hook kind for ``R``, 0/1 for ``G``/``A``."""

    kind: str
    arg: str = ""

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {self.kind!r}")
        if self.kind == "R" and self.arg not in HOOK_KINDS:
            raise ValueError(f"unknown hook kind {self.arg!r}")
        if self.kind in ("G", "A") and self.arg not in ("0", "1"):
            raise ValueError(f"{self.kind} takes 0 or 1, got {self.arg!r}")

    def __str__(self) -> str:
        return self.kind + self.arg

    @classmethod
    def parse(cls, text: str) -> Op:
        for kind in sorted(OP_KINDS, key=len, reverse=True):
            if text.startswith(kind) and (kind in ("R", "G", "A") or text == kind):
                return cls(kind, text[len(kind):])
        raise ValueError(f"cannot parse op {text!r}")


@dataclass(frozen=True)
class Program:
    """One ubatch's ops: ``body`` runs inside ``try``; ``final`` in its ``finally``."""

    body: tuple[Op, ...] = ()
    final: tuple[Op, ...] = ()

    def __str__(self) -> str:
        s = " ".join(map(str, self.body))
        return f"{s} | {' '.join(map(str, self.final))}" if self.final else s

    @classmethod
    def parse(cls, text: str) -> Program:
        body, _, final = text.partition("|")
        return cls(tuple(Op.parse(t) for t in body.split()), tuple(Op.parse(t) for t in final.split()))


@dataclass(frozen=True)
class Case:
    """Programs for ubatches 0..N-1 and the caller's state when ``run_ubatches`` is called."""

    programs: tuple[Program, ...]
    caller_grad: bool = True
    caller_autocast: bool = False
    caller_var: str = "caller"

    def __str__(self) -> str:
        head = f"caller: grad={int(self.caller_grad)} autocast={int(self.caller_autocast)}"
        return "\n".join([head] + [f"ub{i}: {p}" for i, p in enumerate(self.programs)])

    @classmethod
    def parse(cls, text: str, **caller: Any) -> Case:
        progs = []
        for line in text.strip().splitlines():
            _, _, rest = line.partition(":")
            progs.append(Program.parse(rest))
        return cls(tuple(progs), **caller)


@dataclass(frozen=True)
class Event:
    """One log line. ``obs`` is what the code observed: (ubatch id, stream, grad, autocast, var).

    kinds: ``start`` (the ubatch's callable began), ``op`` (op ``name`` completed), ``hook``
    (a hook registered at op ``name`` ran; ``ub`` is the ubatch that ran it), ``finally``
    (``detail``: the exception propagating, or ``-``), ``return`` (the callable returned).
    """

    kind: str
    ub: int
    name: str = ""
    detail: str = ""
    obs: tuple = ()

    def __str__(self) -> str:
        parts = [f"ub{self.ub}", self.kind]
        if self.name:
            parts.append(self.name)
        if self.detail:
            parts.append(self.detail)
        if self.obs:
            uid, stream, grad, autocast, var = self.obs
            parts.append(f"[id={uid} {stream} grad={int(grad)} ac={int(autocast)} var={var}]")
        return " ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """How ``run_ubatches`` ended.

    ``error`` is None (success, ``results`` holds each ubatch's return value),
    ``"UBatchError(<id>, <cause>)"`` or ``"KeyboardInterrupt(<cause>)"``. ``started`` says which
    ubatches ever ran; ``unwind_logged`` lists, in order, the ubatches whose unwinding raised
    something other than GreenletExit (logged, not raised).
    """

    error: str | None
    results: tuple | None
    started: tuple[bool, ...]
    unwind_logged: tuple[int, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """The log, the outcome, and the schedule: ``("resume", ub)`` each time a ubatch starts or
    is resumed, ``("unwind", ub)`` each time GreenletExit is thrown into one, in order."""

    events: tuple[Event, ...]
    outcome: Outcome
    schedule: tuple[tuple[str, int], ...] = ()


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
