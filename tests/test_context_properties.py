"""Random ubatch programs run on the real runtime, checked against the independent model.

The model (:mod:`dbo.testing.model`) predicts the whole log of a run from DESIGN.md's contract;
the interpreter (:mod:`dbo.testing.programs`) runs the same programs with ``run_ubatches`` and
logs what every step observed. They must agree line by line: the interleaving (ring order),
which ubatch runs each recv hook and when, each step's ubatch id, current stream, grad and
autocast mode and contextvar, the ``finally`` blocks of a failing run and their order, which
ubatches never start, and how the run ends. The interpreter also checks on its own that exactly
one ubatch runs, hooks run once and before their registrant continues, and nothing is left
behind. The hand-written cases below pin the model itself to the contract's sentences.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dbo.testing.model import Case, Op, predict
from dbo.testing.programs import cases, check_case


def _short(events) -> list[str]:
    return [" ".join(str(e).split(" [")[0].split()) for e in events]


@given(cases())
def test_case_text_parses_back(case: Case):
    assert Case.parse(str(case).split("\n", 1)[1], caller_grad=case.caller_grad,
                      caller_autocast=case.caller_autocast) == case
    for prog in case.programs:
        for op in prog.body + prog.final:
            assert Op.parse(str(op)) == op


# The core properties run at least 300 examples whatever the profile (about 2 s each).
CORE = settings(max_examples=max(settings.default.max_examples, 300))


@CORE
@given(cases(faults=False))
def test_fault_free_programs_agree_with_the_model(case: Case):
    check_case(case)


@CORE
@given(cases(faults=True))
def test_failing_programs_agree_with_the_model(case: Case):
    check_case(case)


# ---- the model, pinned to the contract's sentences ----------------------------------------

# (case, the log the contract implies without observations, outcome error, started)
SCRIPTS = {
    # "dbo_yield() from ubatch i resumes the next live ubatch in ring order"; "when ubatch i
    # finishes, the next live ubatch in ring order from i runs"
    "ring order": (
        "ub0: Y Y\nub1: Y\nub2: Y Y",
        ["ub0 start", "ub1 start", "ub2 start", "ub0 op 0b0 Y", "ub1 op 1b0 Y", "ub1 finally -",
         "ub1 return", "ub2 op 2b0 Y", "ub0 op 0b1 Y", "ub0 finally -", "ub0 return",
         "ub2 op 2b1 Y", "ub2 finally -", "ub2 return"],
        None, (True, True, True)),
    # "j runs it at its next dbo_maybe_run_recv_hook() ... in j's context"
    "hook at the peer's hook point": (
        "ub0: R Y\nub1: H",
        ["ub0 start", "ub0 op 0b0 R", "ub1 start", "ub1 hook 0b0", "ub1 op 1b0 H", "ub1 finally -",
         "ub1 return", "ub0 op 0b1 Y", "ub0 finally -", "ub0 return"],
        None, (True, True)),
    # "... or when j's callable returns"
    "hook when the peer returns": (
        "ub0: R Y\nub1:",
        ["ub0 start", "ub0 op 0b0 R", "ub1 start", "ub1 finally -", "ub1 return", "ub1 hook 0b0",
         "ub0 op 0b1 Y", "ub0 finally -", "ub0 return"],
        None, (True, True)),
    # "If the hook is still pending when ubatch i is about to resume, it runs then, first
    # thing, in i's context"
    "pending hook runs in its registrant": (
        "ub0: R Y\nub1: Y H",
        ["ub0 start", "ub0 op 0b0 R", "ub1 start", "ub0 hook 0b0", "ub0 op 0b1 Y", "ub0 finally -",
         "ub0 return", "ub1 op 1b0 Y", "ub1 op 1b1 H", "ub1 finally -", "ub1 return"],
        None, (True, True)),
    # "If no other ubatch is live, the hook runs at once"; "If no other ubatch is live it
    # returns at once"
    "alone": (
        "ub0: Y R Y\nub1:",
        ["ub0 start", "ub1 start", "ub1 finally -", "ub1 return", "ub0 op 0b0 Y", "ub0 hook 0b1",
         "ub0 op 0b1 R", "ub0 op 0b2 Y", "ub0 finally -", "ub0 return"],
        None, (True, True)),
    # "throws GreenletExit into every other started ubatch, in ring order from the failing
    # one ... ubatches that had not started never start"
    "failure unwinds in ring order": (
        "ub0: Y\nub1: Y\nub2: X\nub3: Y",
        ["ub0 start", "ub1 start", "ub2 start", "ub2 finally err:2b0", "ub0 finally GreenletExit",
         "ub1 finally GreenletExit"],
        "UBatchError(2, err:2b0)", (True, True, True, False)),
    # "pending hooks are dropped"; KeyboardInterrupt "propagates unwrapped after the same
    # unwinding"
    "interrupt drops pending hooks": (
        "ub0: R Y\nub1: I",
        ["ub0 start", "ub0 op 0b0 R", "ub1 start", "ub1 finally kbd:1b0", "ub0 finally GreenletExit"],
        "KeyboardInterrupt(kbd:1b0)", (True, True)),
    # "Registering into an occupied slot is an error"
    "occupied slot": (
        "ub0: R R\nub1:",
        ["ub0 start", "ub0 op 0b0 R", "ub0 finally HookSlotOccupiedError"],
        "UBatchError(0, HookSlotOccupiedError)", (True, False)),
    # "A hook may not yield or register hooks"; a hook's error is its runner's
    "hook that yields": (
        "ub0: Ry Y\nub1: H",
        ["ub0 start", "ub0 op 0b0 Ry", "ub1 start", "ub1 hook 0b0", "ub1 finally HookMisuseError",
         "ub0 finally GreenletExit"],
        "UBatchError(1, HookMisuseError)", (True, True)),
    # "An exception raised while unwinding another ubatch is logged, not raised"
    "error while unwinding": (
        "ub0: Y | X\nub1: X",
        ["ub0 start", "ub1 start", "ub1 finally err:1b0", "ub0 finally GreenletExit"],
        "UBatchError(1, err:1b0)", (True, True)),
    # while unwinding, the victim is the only live ubatch: its yields return at once and a
    # hook it registers runs at once
    "unwinding never hangs": (
        "ub0: Y | Y R\nub1: X",
        ["ub0 start", "ub1 start", "ub1 finally err:1b0", "ub0 finally GreenletExit",
         "ub0 op 0f0 Y", "ub0 hook 0f1", "ub0 op 0f1 R"],
        "UBatchError(1, err:1b0)", (True, True)),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_model_follows_the_contract(name: str):
    text, log, error, started = SCRIPTS[name]
    case = Case.parse(text)
    pred = predict(case)
    assert _short(pred.events) == log
    assert pred.outcome.error == error
    assert pred.outcome.started == started
    if name == "error while unwinding":
        assert pred.outcome.unwind_logged == (0,)
    check_case(case)


def test_model_tracks_streams_modes_and_contextvars():
    case = Case.parse("ub0: CS G0 V Y YK A1 Y\nub1: Y C Y", caller_var="outer")
    obs = {f"{e.name} {e.kind}": e.obs for e in predict(case).events if e.kind == "op"}
    assert obs["0b2 op"] == (0, "comm", False, False, "0b2")
    assert obs["1b0 op"] == (1, "compute", True, False, "outer")  # nothing of ub0's leaks
    assert obs["0b4 op"] == (0, "compute", False, False, "0b2")
    assert obs["1b2 op"] == (1, "comm", True, False, "outer")
    assert obs["0b6 op"] == (0, "compute", False, True, "0b2")
    check_case(case)
