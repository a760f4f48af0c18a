"""The property check catches broken runtimes: proof that it can fail.

Each test breaks one promise of the contract by replacing one of the names that
:mod:`dbo.ubatch.driver` documents as its seam for these tests (wrong
ring order, a hook not run when its slot's ubatch returns, a pending hook not run when its
registrant resumes, no unwinding, the stream or grad mode not restored at a switch, ubatches
not started in a copy of the caller's contextvars), then lets hypothesis search the same
random programs the property tests use for one that the check rejects, and asserts the
check's failure on it. ``test_faithful_reimplementation_passes`` runs the patched yield with
nothing removed, so a failure below is due to the removed piece, not to the patching.
"""

from __future__ import annotations

import gc

import pytest
from hypothesis import Phase, find, given, settings

from dbo.errors import HookMisuseError
from dbo.testing.model import Case
from dbo.testing.programs import ContractViolation, cases, check_case
from dbo.ubatch.driver import Run
from dbo.ubatch.modes import capture_modes
from dbo.ubatch.state import DONE, FAILED, UBatchContext

# Searching is quick; shrinking to the smallest case would take seconds per test.
SEARCH = settings(max_examples=400, database=None, derandomize=True, deadline=None,
                  phases=[Phase.explicit, Phase.generate])


def _violates(case: Case) -> bool:
    try:
        check_case(case)
    except ContractViolation:
        return True
    return False


def find_violation(strategy=None) -> Case:
    """The smallest case the check rejects (hypothesis.find), or NoSuchExample."""
    return find(cases() if strategy is None else strategy, _violates, settings=SEARCH)


def make_yield_variant(*, ring_step: int = 1, restore_stream: bool = True, restore_modes: bool = True,
                       run_pending_hook: bool = True):
    """A stand-in for ``Run.make_yield`` with one piece optionally removed."""

    def make_yield(run: Run):
        def yield_current() -> None:
            if run.in_hook:
                raise HookMisuseError("a recv hook may not yield")
            if run.live_count < 2:
                return
            ctx = run.current
            stream = ctx.stream_key = run.current_stream()
            modes = ctx.modes = capture_modes()
            n, i = len(run.contexts), ctx.id
            while True:
                i = (i + ring_step) % n
                if run.contexts[i].live:
                    break
            nxt = run.contexts[i]
            if restore_modes and nxt.modes != modes:
                run.modes.apply(nxt.modes, modes)
            if restore_stream and nxt.stream_key != stream:
                run.set_stream(nxt.stream_key)
            run.current = nxt
            nxt.resume()
            pending = ctx.hook_pending_in
            if run_pending_hook and pending is not None:
                pending.run_hook_in(ctx)

        return yield_current

    return make_yield


@given(cases())
def test_faithful_reimplementation_passes(case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "make_yield", make_yield_variant())
        check_case(case)


def test_wrong_ring_order_is_caught(monkeypatch):
    monkeypatch.setattr(Run, "make_yield", make_yield_variant(ring_step=-1))
    case = find_violation()
    assert len(case.programs) >= 3  # with two ubatches both directions agree
    with pytest.raises(ContractViolation, match="log differs from the model"):
        check_case(case)


def test_stream_not_restored_is_caught(monkeypatch):
    monkeypatch.setattr(Run, "make_yield", make_yield_variant(restore_stream=False))
    case = find_violation(cases(faults=False))
    with pytest.raises(ContractViolation, match="not restored after a switch"):
        check_case(case)


def test_grad_mode_not_restored_is_caught(monkeypatch):
    monkeypatch.setattr(Run, "make_yield", make_yield_variant(restore_modes=False))
    case = find_violation(cases(faults=False))
    with pytest.raises(ContractViolation, match="not restored after a switch"):
        check_case(case)


def test_pending_hook_not_run_at_registrant_resume_is_caught(monkeypatch):
    monkeypatch.setattr(Run, "make_yield", make_yield_variant(run_pending_hook=False))
    case = find_violation(cases(faults=False))
    with pytest.raises(ContractViolation, match="continued before its hooks"):
        check_case(case)


def test_hook_not_run_when_its_slots_ubatch_returns_is_caught(monkeypatch):
    def body_without_final_hook(self, fn):
        def body():
            self.started = True
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - as the real body
                return (FAILED, exc)
            return (DONE, result)

        return body

    monkeypatch.setattr(UBatchContext, "body", body_without_final_hook)
    case = find_violation(cases(faults=False))
    with pytest.raises(ContractViolation, match="log differs from the model"):
        check_case(case)


def test_no_unwinding_is_caught(monkeypatch):
    leaked: list[Run] = []  # keep the never-unwound greenlets alive until the search is over

    monkeypatch.setattr(Run, "unwind", lambda self, failed: leaked.append(self))
    try:
        case = find_violation(cases(faults=True))
        with pytest.raises(ContractViolation, match="log differs from the model"):
            check_case(case)
    finally:
        monkeypatch.undo()
        leaked.clear()
        gc.collect()  # their finally blocks run now, outside any run: their ops are no-ops


def test_contextvars_not_copied_is_caught(monkeypatch):
    init = UBatchContext.__init__

    def init_without_context(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._greenlet.gr_context = None  # starts in an empty context

    monkeypatch.setattr(UBatchContext, "__init__", init_without_context)
    case = find_violation(cases(faults=False))
    with pytest.raises(ContractViolation, match="not restored after a switch"):
        check_case(case)
