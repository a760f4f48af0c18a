"""Misuse, failure and isolation of the ubatch context (DESIGN.md, "The ubatch context").

Each misuse raises the project's named error (inside a ubatch: as the ``UBatchError``'s
``__cause__``); ``KeyboardInterrupt``/``SystemExit`` propagate unwrapped after unwinding; an
error while unwinding is logged, not raised; runs are per thread; thread state (inference mode,
autocast, current stream) is kept per ubatch; outside a run every ``dbo_*`` call is a no-op.
The autouse fixture in conftest checks that no run or stream is left behind after each test.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import dbo
from dbo import (
    DBOError,
    HookMisuseError,
    HookSlotOccupiedError,
    NestedRunError,
    StreamStateError,
    UBatchCountError,
    UBatchError,
    dbo_current_ubatch_id,
    dbo_current_ubatch_token_offset,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo.ubatch.streams import STREAM_POOL


def run(*fns, **kw):
    return run_ubatches(list(fns), device="cpu", **kw)


def failing_run(*fns, **kw) -> UBatchError:
    with pytest.raises(UBatchError) as info:
        run(*fns, **kw)
    assert dbo.active_run() is None and not dbo_enabled()
    return info.value


def noop():
    return None


# ---- caller mistakes, before anything runs -------------------------------------------------


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_ubatches_is_a_value_error(n):
    called = []
    with pytest.raises(UBatchCountError) as info:
        run(*[lambda: called.append(1)] * n)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DBOError)
    assert called == [] and not dbo_enabled()


def test_token_offsets_of_the_wrong_length():
    with pytest.raises(UBatchCountError):
        run(noop, noop, token_offsets=[0])


def test_a_ubatch_that_is_not_callable():
    with pytest.raises(TypeError):
        run(noop, 3)


def test_comm_stream_equal_to_the_callers_stream():
    with pytest.raises(ValueError):
        run(noop, noop, comm_stream=STREAM_POOL.get("cpu").current())


# ---- protocol violations inside a ubatch ---------------------------------------------------


def test_nested_run_fails_the_ubatch_and_unwinds_the_others():
    finals = []

    def outer():
        try:
            dbo_yield()
        finally:
            finals.append(0)

    def nester():
        run(noop, noop)

    err = failing_run(outer, nester)
    assert err.ubatch_id == 1 and isinstance(err.__cause__, NestedRunError)
    assert isinstance(err.__cause__, DBOError) and finals == [0]


def test_yield_inside_a_hook():
    def a():
        dbo_register_recv_hook(dbo_yield)
        dbo_yield()

    def b():
        dbo_maybe_run_recv_hook()

    err = failing_run(a, b)
    assert err.ubatch_id == 1 and isinstance(err.__cause__, HookMisuseError)


def test_register_inside_a_hook():
    def a():
        dbo_register_recv_hook(lambda: dbo_register_recv_hook(noop))
        dbo_yield()

    err = failing_run(a, noop)  # ubatch 1 runs the hook when it returns
    assert err.ubatch_id == 1 and isinstance(err.__cause__, HookMisuseError)


def test_register_into_an_occupied_slot_twice():
    def a():
        dbo_register_recv_hook(noop)
        dbo_register_recv_hook(noop)

    err = failing_run(a, noop)
    assert err.ubatch_id == 0 and isinstance(err.__cause__, HookSlotOccupiedError)


def test_register_into_a_slot_another_ubatch_occupies():
    # ub0 fills ub1's slot and returns; ub1 yields without running it; ub2's next live
    # ubatch is then ub1, whose slot is still occupied.
    def a():
        dbo_register_recv_hook(noop)

    def c():
        dbo_register_recv_hook(noop)

    err = failing_run(a, dbo_yield, c)
    assert err.ubatch_id == 2 and isinstance(err.__cause__, HookSlotOccupiedError)
    assert "ubatch 0" in str(err.__cause__)


@pytest.mark.parametrize("fn", [dbo_yield_and_switch_from_comm_to_compute,
                                lambda: (dbo_switch_to_comm(), dbo_yield_and_switch_from_compute_to_comm())])
def test_yield_and_switch_from_the_wrong_stream(fn):
    err = failing_run(fn, noop)
    assert isinstance(err.__cause__, StreamStateError)


def test_ubatch_error_names_the_failing_ubatch_and_chains_the_cause():
    boom = RuntimeError("boom")

    def b():
        dbo_yield()
        raise boom

    err = failing_run(dbo_yield, b, dbo_yield)
    assert err.ubatch_id == 1 and err.__cause__ is boom
    assert "ubatch 1" in str(err) and "boom" in str(err)


# ---- interrupts and errors while unwinding --------------------------------------------------


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupts_propagate_unwrapped_after_unwinding(exc_type):
    log = []

    def victim(i):
        def fn():
            try:
                log.append(f"start {i}")
                dbo_yield()
                log.append(f"resumed {i}")
            finally:
                log.append(f"finally {i}")
        return fn

    def interrupted():
        raise exc_type("stop")

    with pytest.raises(exc_type) as info:
        run(victim(0), interrupted, victim(2), victim(3))
    assert type(info.value) is exc_type and info.value.args == ("stop",)
    # ring order from the failing ubatch; ubatches 2 and 3 never started
    assert log == ["start 0", "finally 0"]
    assert not dbo_enabled()


def test_an_error_while_unwinding_is_logged_not_raised(caplog):
    original = ValueError("original")

    def victim():
        try:
            dbo_yield()
        finally:
            raise RuntimeError("while unwinding")

    def failing():
        raise original

    with caplog.at_level(logging.ERROR, logger="dbo.ubatch.context"):
        err = failing_run(victim, failing)
    assert err.ubatch_id == 1 and err.__cause__ is original
    records = [r for r in caplog.records if r.name == "dbo.ubatch.context"]
    assert len(records) == 1 and "ubatch 0" in records[0].getMessage()
    assert "while unwinding" in caplog.text


def test_unwinding_never_hangs_on_yields_and_hooks_in_finally_blocks():
    ran = []

    def victim():
        try:
            dbo_yield()
        finally:
            for _ in range(3):
                dbo_yield()  # the only live ubatch: returns at once
            dbo_register_recv_hook(lambda: ran.append(dbo_current_ubatch_id()))

    def failing():
        raise ValueError

    failing_run(victim, failing)
    assert ran == [0]


# ---- isolation ------------------------------------------------------------------------------


def test_results_and_token_offsets():
    def fn():
        dbo_yield()
        return (dbo_current_ubatch_id(), dbo_current_ubatch_token_offset(), dbo.dbo_num_ubatches())

    assert run(fn, fn, fn, token_offsets=[0, 5, 9]) == [(0, 0, 3), (1, 5, 3), (2, 9, 3)]
    assert run(fn, fn) == [(0, 0, 2), (1, 0, 2)]


def test_outside_a_run_every_dbo_function_is_a_no_op():
    ran = []
    assert not dbo_enabled() and dbo_current_ubatch_id() == 0
    assert dbo_current_ubatch_token_offset() == 0 and dbo.dbo_num_ubatches() == 1
    for f in (dbo_yield, dbo_maybe_run_recv_hook, dbo_switch_to_comm, dbo.dbo_switch_to_compute,
              dbo.dbo_switch_to_comm_sync, dbo.dbo_switch_to_compute_sync,
              dbo_yield_and_switch_from_compute_to_comm, dbo_yield_and_switch_from_comm_to_compute):
        f()
    dbo_register_recv_hook(lambda: ran.append("hook"))
    assert dbo_get_previous_event(lambda: ran.append("event")) is None
    assert ran == ["hook"]


def test_previous_event_is_taken_on_the_compute_stream():
    streams = STREAM_POOL.get("cpu")
    seen = []

    def fn():
        dbo_switch_to_comm()
        seen.append(dbo_get_previous_event(lambda: streams.current()))
        seen.append(streams.current())

    run(fn, noop)
    assert seen == [streams.current(), streams.comm_stream]


def test_runs_on_different_threads_do_not_see_each_other():
    inside, release = threading.Event(), threading.Event()
    other = {}

    def blocking():
        inside.set()
        assert release.wait(30)
        return dbo_current_ubatch_id()

    def thread_main():
        other["result"] = run(blocking, lambda: dbo_current_ubatch_id())

    t = threading.Thread(target=thread_main)
    t.start()
    try:
        assert inside.wait(30)
        assert not dbo_enabled() and dbo.active_run() is None  # not this thread's run
        assert run(dbo_current_ubatch_id, dbo_current_ubatch_id) == [0, 1]
    finally:
        release.set()
        t.join(30)
    assert other["result"] == [0, 1]


def test_inference_mode_and_autocast_are_kept_per_ubatch():
    seen = []

    def a():
        with torch.inference_mode():
            dbo_yield()
            seen.append(("a", torch.is_inference_mode_enabled()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dbo_yield()
            seen.append(("a", torch.is_autocast_enabled("cpu")))

    def b():
        seen.append(("b", torch.is_inference_mode_enabled()))
        with torch.inference_mode(False):
            dbo_yield()
        seen.append(("b", torch.is_autocast_enabled("cpu")))

    with torch.no_grad():
        run(a, b)
        assert not torch.is_grad_enabled()
    assert seen == [("b", False), ("a", True), ("b", False), ("a", True)]
    assert not torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu")


def test_callers_inference_mode_is_restored_after_a_failure():
    def a():
        torch.set_grad_enabled(True)
        with torch.inference_mode(False):
            dbo_yield()

    def b():
        torch.set_autocast_enabled("cpu", True)
        raise ValueError

    with torch.inference_mode():
        failing_run(a, b)
        assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
    assert run(noop, noop) == [None, None]  # a second run works
