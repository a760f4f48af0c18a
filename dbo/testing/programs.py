"""Ubatch programs on the real runtime: an interpreter, and the check against the model.

:func:`run_case` runs a :class:`dbo.testing.ops.Case` with ``run_ubatches(..., device="cpu")``:
each ubatch's callable interprets its program and logs what it observes, in the same
:class:`~dbo.testing.ops.Event` form the model predicts. While it runs it also checks, on its
own, what every step must satisfy (exactly one ubatch running, the ubatch's stream, grad and
autocast mode and contextvar what it last set, hooks run once and before their registrant
continues, nothing left behind after the run) and lists what failed in ``violations``.
:func:`check_case` compares the run with :func:`dbo.testing.model.predict` and raises
:class:`ContractViolation` with both timelines, the first difference marked. The hypothesis
strategies that draw programs live in :mod:`dbo.testing.strategies` (importable from here).
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis.control import currently_in_test_context, note

from dbo.errors import UBatchError
from dbo.testing.model import predict
from dbo.testing.ops import Case, Event, Op, Outcome, Prediction, describe_raise, op_name
from dbo.testing.strategies import FAULT_OPS, FINAL_OPS, SAFE_OPS, cases
from dbo.ubatch.context import (
    active_run,
    dbo_current_context,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_region,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo.ubatch.streams import STREAM_POOL
from dbo.ubatch.trace import Trace

__all__ = [
    "VAR",
    "ProgramError",
    "ContractViolation",
    "Observed",
    "SAFE_OPS",
    "FAULT_OPS",
    "FINAL_OPS",
    "cases",
    "run_case",
    "run_programs",
    "check_case",
    "render_mismatch",
]

#: the contextvar programs set (op ``V``); each ubatch must see only its own value
VAR: contextvars.ContextVar[str] = contextvars.ContextVar("dbo_testing_programs_var", default="unset")


class ProgramError(Exception):
    """What an ``X`` op or a ``R!`` hook raises; ``args[0]`` is its name."""


class ContractViolation(AssertionError):
    """The real run disagrees with the model or broke an invariant; the message is the script."""


# ---- running programs on the real runtime -------------------------------------------------


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ProgramError):
        return describe_raise("X", str(exc.args[0]))
    if isinstance(exc, KeyboardInterrupt):
        return describe_raise("I", str(exc.args[0]) if exc.args else "")
    return type(exc).__name__


@dataclass
class Observed:
    """What a real run did: its log, how it ended, and the invariants it broke."""

    events: list[Event] = field(default_factory=list)
    outcome: Outcome | None = None
    violations: list[str] = field(default_factory=list)


class _Interpreter:
    def __init__(self, n: int, finals: Sequence[tuple[Op, ...]], source: Callable[[int, int], Any],
                 case: Case, regions: bool):
        self.n, self.finals, self.source, self.case, self.regions = n, finals, source, case, regions
        self.streams = STREAM_POOL.get("cpu")
        self.compute = self.streams.current()
        self.comm = self.streams.comm_stream
        self.seen = Observed()
        self.running = 0
        self.unwinding = False
        self.started = [False] * n
        self.expect = [["compute", case.caller_grad, case.caller_autocast, case.caller_var]
                       for _ in range(n)]
        self.registered: list[str] = []
        self.hook_runs: Counter[str] = Counter()
        self.unrun: list[set[str]] = [set() for _ in range(n)]

    def violation(self, msg: str) -> None:
        self.seen.violations.append(msg)

    def observe(self) -> tuple:
        cur = self.streams.current()
        ctx = dbo_current_context()
        if ctx is not None and ctx.current_stream is not cur:
            self.violation(f"ub{ctx.id}: ctx.current_stream {ctx.current_stream} is not the "
                           f"thread's current stream {cur}")
        stream = "compute" if cur is self.compute else "comm" if cur is self.comm else repr(cur)
        return (dbo_current_ubatch_id(), stream, torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"), VAR.get())

    def log(self, kind: str, u: int, name: str = "", detail: str = "") -> None:
        obs = self.observe()
        self.seen.events.append(Event(kind, u, name, detail, obs))
        where = " ".join(x for x in (f"ub{u}", kind, name, detail) if x)
        if self.running != 1:
            self.violation(f"{where}: {self.running} ubatches running, not 1")
        if obs[0] != u:
            self.violation(f"{where}: dbo_current_ubatch_id() is {obs[0]}")
        if list(obs[1:]) != self.expect[u]:
            self.violation(f"{where}: observed (stream, grad, autocast, var) {obs[1:]}, expected "
                           f"{tuple(self.expect[u])}: not restored after a switch?")

    def make_hook(self, u: int, name: str, kind: str) -> Callable[[], None]:
        def hook() -> None:
            obs = self.observe()
            runner = obs[0]
            self.seen.events.append(Event("hook", runner, name, "", obs))
            self.hook_runs[name] += 1
            self.unrun[u].discard(name)
            if self.hook_runs[name] > 1:
                self.violation(f"hook {name} ran {self.hook_runs[name]} times")
            if self.running > 1:
                self.violation(f"hook {name}: {self.running} ubatches running")
            if list(obs[1:]) != self.expect[runner]:
                self.violation(f"hook {name} ran in ub{runner} with state {obs[1:]}, not "
                               f"ub{runner}'s {tuple(self.expect[runner])}")
            if kind == "!":
                raise ProgramError("h" + name)
            if kind == "y":
                dbo_yield()
            elif kind == "r":
                dbo_register_recv_hook(lambda: None)

        return hook

    def switch(self, u: int, fn: Callable[[], None]) -> None:
        self.running -= 1
        try:
            fn()
        finally:
            self.running += 1
        if self.unrun[u] and not self.unwinding:
            self.violation(f"ub{u} continued before its hooks {sorted(self.unrun[u])} ran")

    def exec(self, u: int, op: Op, name: str) -> None:
        if not dbo_enabled():
            self.violation(f"ub{u} op {name} ran outside the run")
            return
        k, exp = op.kind, self.expect[u]
        if k == "Y":
            self.switch(u, dbo_yield)
        elif k in ("C", "CS", "K", "KS"):
            {"C": dbo_switch_to_comm, "CS": dbo_switch_to_comm_sync, "K": dbo_switch_to_compute,
             "KS": dbo_switch_to_compute_sync}[k]()
            exp[0] = "comm" if k in ("C", "CS") else "compute"
        elif k == "YC":
            self.switch(u, dbo_yield_and_switch_from_compute_to_comm)
            exp[0] = "comm"
        elif k == "YK":
            self.switch(u, dbo_yield_and_switch_from_comm_to_compute)
            exp[0] = "compute"
        elif k == "R":
            self.registered.append(name)
            self.unrun[u].add(name)
            try:
                dbo_register_recv_hook(self.make_hook(u, name, op.arg))
            except BaseException:
                self.registered.pop()
                self.unrun[u].discard(name)
                raise
        elif k == "H":
            dbo_maybe_run_recv_hook()
        elif k == "G":
            torch.set_grad_enabled(op.arg == "1")
            exp[1] = op.arg == "1"
        elif k == "A":
            torch.set_autocast_enabled("cpu", op.arg == "1")
            exp[2] = op.arg == "1"
        elif k == "V":
            VAR.set(name)
            exp[3] = name
        elif k == "X":
            raise ProgramError(name)
        elif k == "I":
            raise KeyboardInterrupt(name)
        else:
            raise ValueError(f"op {op} cannot run")

    def run_ops(self, u: int, section: str, ops: Sequence[Op]) -> None:
        for i, op in enumerate(ops):
            name = op_name(u, section, i)
            self.exec(u, op, name)
            self.log("op", u, name, str(op))

    def body(self, u: int) -> Any:
        self.running += 1
        self.started[u] = True
        try:
            self.log("start", u)
            try:
                i = 0
                while True:
                    op = self.source(u, i)
                    if op is None or op.kind == "END":
                        break
                    name = op_name(u, "b", i)
                    self.exec(u, op, name)
                    self.log("op", u, name, str(op))
                    i += 1
            except BaseException as exc:
                if type(exc).__name__ == "GreenletExit":
                    self.unwinding = True
                self.log("finally", u, "", _describe(exc))
                self.run_ops(u, "f", self.finals[u])
                raise
            self.log("finally", u, "", "-")
            self.run_ops(u, "f", self.finals[u])
            self.log("return", u)
            return f"r{u}"
        finally:
            self.running -= 1

    def fn(self, u: int) -> Callable[[], Any]:
        if not self.regions:
            return lambda: self.body(u)

        def with_region() -> Any:
            with dbo_region(f"ub{u}"):
                return self.body(u)

        return with_region


class _UnwindLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.ubatches: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"ubatch (\d+)", record.getMessage())
        self.ubatches.append(int(m.group(1)) if m else -1)


def run_programs(n: int, finals: Sequence[tuple[Op, ...]], source: Callable[[int, int], Any], *,
                 case: Case, trace: Trace | None = None, regions: bool = False,
                 observed: Observed | None = None) -> Observed:
    """Run ``n`` interpreted ubatches; ``source(ub, i)`` gives ubatch ``ub``'s ``i``-th body op
    (None or ``END``: return). ``case`` gives the caller's grad/autocast/contextvar state.
    Events are appended to ``observed`` (a fresh :class:`Observed` if None) as they happen."""
    interp = _Interpreter(n, finals, source, case, regions)
    if observed is not None:
        interp.seen = observed
    seen = interp.seen
    handler = _UnwindLog()
    logger = logging.getLogger("dbo.ubatch.context")
    grad_before, autocast_before = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
    token = VAR.set(case.caller_var)
    torch.set_grad_enabled(case.caller_grad)
    torch.set_autocast_enabled("cpu", case.caller_autocast)
    logger.addHandler(handler)
    try:
        error, results = None, None
        try:
            results = tuple(run_ubatches([interp.fn(u) for u in range(n)], device="cpu", trace=trace))
        except UBatchError as exc:
            error = f"UBatchError({exc.ubatch_id}, {_describe(exc.__cause__)})"
            if exc.__cause__ is None:
                interp.violation("UBatchError without __cause__")
        except KeyboardInterrupt as exc:
            error = f"KeyboardInterrupt({_describe(exc)})"
        seen.outcome = Outcome(error, results, tuple(interp.started), tuple(handler.ubatches))
        after = (active_run(), dbo_enabled(), interp.streams.current() is interp.compute,
                 torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), VAR.get())
        want = (None, False, True, case.caller_grad, case.caller_autocast, case.caller_var)
        if after != want:
            interp.violation(f"state left behind: (run, enabled, stream restored, grad, autocast, "
                             f"var) = {after}, expected {want}")
        if interp.running != 0:
            interp.violation(f"{interp.running} ubatches still running after the run")
        for name in interp.registered:
            runs = interp.hook_runs[name]
            if runs > 1 or (runs == 0 and error is None):
                interp.violation(f"hook {name} ran {runs} times")
    finally:
        logger.removeHandler(handler)
        VAR.reset(token)
        torch.set_grad_enabled(grad_before)
        torch.set_autocast_enabled("cpu", autocast_before)
    return seen


def run_case(case: Case, *, trace: Trace | None = None, regions: bool = False) -> Observed:
    """Run ``case`` on the real runtime (CPU stand-in) and return what happened."""
    progs = case.programs

    def source(u: int, i: int) -> Op | None:
        return progs[u].body[i] if i < len(progs[u].body) else None

    return run_programs(len(progs), [p.final for p in progs], source, case=case, trace=trace,
                        regions=regions)


def _note(text: str) -> None:
    if currently_in_test_context():
        note(text)


def render_mismatch(case: Case | str, pred: Prediction, seen: Observed) -> str | None:
    """None if ``seen`` matches ``pred`` and broke no invariant, else the whole story."""
    exp, got = [str(e) for e in pred.events], [str(e) for e in seen.events]
    problems = list(seen.violations)
    pairs = enumerate(zip(exp, got, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), min(len(exp), len(got)))
    if exp != got:
        problems.append(f"log differs from the model at line {first}")
    if pred.outcome != seen.outcome:
        problems.append(f"outcome: model {pred.outcome}, real {seen.outcome}")
    if not problems:
        return None
    width = max([len(s) for s in exp] + [5])
    lines = [str(case), "", *problems, "", f"     {'model':<{width}} | real"]
    for i in range(max(len(exp), len(got))):
        a = exp[i] if i < len(exp) else ""
        b = got[i] if i < len(got) else ""
        mark = ">>" if i == first and exp != got else ("!=" if a != b else "  ")
        lines.append(f"{mark}{i:3d} {a:<{width}} | {b}")
    return "\n".join(lines)


def check_case(case: Case, *, trace: Trace | None = None, regions: bool = False) -> Observed:
    """Run ``case`` and compare with the model; raise :class:`ContractViolation` on any
    difference. Every logged step is passed to hypothesis ``note()`` (inside a test)."""
    _note(str(case))
    pred = predict(case)
    seen = run_case(case, trace=trace, regions=regions)
    for ev in seen.events:
        _note(str(ev))
    _note(f"outcome: {seen.outcome}")
    msg = render_mismatch(case, pred, seen)
    if msg is not None:
        raise ContractViolation(msg)
    return seen
