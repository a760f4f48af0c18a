"""A hypothesis state machine that drives a real run one op at a time next to the model.

The run lives on a worker thread (runs are per thread) inside ``run_ubatches``; whichever
ubatch is running asks the machine for its next op and blocks until it gets one. Each rule
hands one op (or ``END``: return from the body) to that ubatch, and the same op to
:class:`dbo.testing.model.OnlineModel`; the invariant compares, after every step, the new log
lines, which ubatch runs next, and at the end how the run ended. Every step is ``note()``-d,
so a failure reads as a script of the ops that led to it.
"""

from __future__ import annotations

import queue
import threading
from itertools import zip_longest

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dbo.testing.model import Case, OnlineModel, Op, Program
from dbo.testing.programs import FAULT_OPS, FINAL_OPS, SAFE_OPS, Observed, run_programs

TIMEOUT_S = 30.0
END = Op("END")


class RealRun:
    """``run_programs`` on a worker thread, fed ops through a queue."""

    def __init__(self, n: int, case: Case):
        self.inbox: queue.Queue[Op] = queue.Queue()
        self.outbox: queue.Queue[tuple] = queue.Queue()
        self.observed = Observed()

        def source(u: int, i: int) -> Op:
            self.outbox.put(("ready", u))
            return self.inbox.get(timeout=TIMEOUT_S)

        def main() -> None:
            try:
                seen = run_programs(n, [p.final for p in case.programs], source, case=case,
                                    observed=self.observed)
                self.outbox.put(("done", seen.outcome))
            except BaseException as exc:  # noqa: BLE001 - reported to the machine
                self.outbox.put(("crash", exc))

        self.thread = threading.Thread(target=main, name="dbo-stateful-run", daemon=True)
        self.thread.start()
        self.state = self._wait()

    def _wait(self) -> tuple:
        try:
            return self.outbox.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the real run hung (no answer in {TIMEOUT_S} s)") from None

    def feed(self, op: Op) -> None:
        self.inbox.put(op)
        self.state = self._wait()
        if self.state[0] != "ready":
            self.thread.join(TIMEOUT_S)
            assert not self.thread.is_alive(), "the run's thread did not end"


class UBatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: OnlineModel | None = None
        self.real: RealRun | None = None
        self.compared = 0

    def active(self) -> bool:
        return self.model is not None and self.model.outcome is None

    @precondition(lambda self: not self.active())
    @rule(n=st.integers(2, 4), finals=st.lists(st.lists(st.sampled_from(FINAL_OPS), max_size=2),
                                                min_size=4, max_size=4),
          caller_grad=st.booleans(), caller_autocast=st.booleans())
    def start_run(self, n, finals, caller_grad, caller_autocast):
        finals = [tuple(f) for f in finals[:n]]
        case = Case(tuple(Program((), f) for f in finals), caller_grad, caller_autocast)
        note(f"--- new run of {n} ubatches (finally: {[' '.join(map(str, f)) for f in finals]}, "
             f"caller grad={int(caller_grad)} autocast={int(caller_autocast)})")
        self.model = OnlineModel(n, finals, caller_grad=caller_grad, caller_autocast=caller_autocast)
        self.real = RealRun(n, case)
        self.compared = 0

    def _feed(self, op: Op) -> None:
        note(f"ub{self.model.waiting} <- {op}")
        self.model.feed(op)
        self.real.feed(op)

    @precondition(active)
    @rule(op=st.sampled_from(SAFE_OPS))
    def step(self, op):
        self._feed(op)

    @precondition(active)
    @rule(op=st.sampled_from(FAULT_OPS))
    def fault(self, op):
        self._feed(op)

    @precondition(active)
    @rule()
    def end_body(self):
        self._feed(END)

    @invariant()
    def real_run_follows_the_model(self):
        if self.model is None:
            return
        exp = [str(e) for e in self.model.events]
        got = [str(e) for e in self.real.observed.events]
        for line in got[self.compared:]:
            note(f"    {line}")
        assert got == exp, "log differs from the model:\n" + "\n".join(
            f"{'  ' if a == b else '>>'} {a:<60} | {b}" for a, b in zip_longest(exp, got, fillvalue=""))
        self.compared = len(got)
        kind = self.real.state[0]
        assert kind != "crash", f"the real run raised {self.real.state[1]!r}"
        if self.model.outcome is None:
            assert self.real.state == ("ready", self.model.waiting), (
                f"model: ub{self.model.waiting} runs next; real: {self.real.state}")
        else:
            note(f"    outcome: {self.model.outcome}")
            assert self.real.state == ("done", self.model.outcome), (
                f"model outcome {self.model.outcome}; real {self.real.state}")
            assert not self.real.observed.violations, "\n".join(self.real.observed.violations)

    def teardown(self) -> None:
        # Finish a run left open: every ubatch returns from its body.
        if self.real is None:
            return
        for _ in range(64):
            if self.active():
                self.model.feed(END)
            if self.real.state[0] != "ready":
                break
            self.real.feed(END)
        self.real.thread.join(TIMEOUT_S)


TestUBatchMachine = UBatchMachine.TestCase
