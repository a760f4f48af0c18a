"""The CPU stand-in detects a missing event wait, and its happens-before is the real one.

Each switching function is run twice inside ``run_ubatches`` under a ``RaceDetector``: as is
(no race may be reported) and with its event wait left out, by calling the plain switch
instead (the race must be reported). The run's own joins (comm waits for the caller's stream
at the start, the caller's stream waits for comm at the end) are checked the same way. A
property test compares the stand-in's vector clocks with an independent reachability model of
streams and events.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from dbo import (
    dbo_current_context,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_deferred,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo.ubatch.streams import STREAM_POOL, LogicalEvent, LogicalStream, RaceDetector, record_access


def _yield_then(switch):
    def missing_wait():
        dbo_yield()
        switch()

    return missing_wait


def _deferred_then_wait():
    wait = dbo_switch_to_compute_deferred()
    record_access("z", write=True, label="ub0 queues unrelated compute before the wait")
    wait()


def _deferred_never_waits():
    dbo_switch_to_compute_deferred()
    record_access("z", write=True, label="ub0 queues unrelated compute")


# (name, stream the producer starts on, the switch with its wait, the same switch without it)
SWITCHES = [
    ("deferred comm->compute", dbo_switch_to_comm, _deferred_then_wait, _deferred_never_waits),
    ("compute->comm", None, dbo_switch_to_comm_sync, dbo_switch_to_comm),
    ("comm->compute", dbo_switch_to_comm, dbo_switch_to_compute_sync, dbo_switch_to_compute),
    ("yield compute->comm", None, dbo_yield_and_switch_from_compute_to_comm,
     _yield_then(dbo_switch_to_comm)),
    ("yield comm->compute", dbo_switch_to_comm, dbo_yield_and_switch_from_comm_to_compute,
     _yield_then(dbo_switch_to_compute)),
]


def handoff_races(prologue, switch) -> list:
    """Ubatch 0 writes ``x`` on one stream, switches, reads ``x`` on the other; ubatch 1 works
    on its own data in between. Returns the races the detector reports."""

    def producer():
        if prologue is not None:
            prologue()
        record_access("x", write=True, label="ub0 writes x")
        switch()
        record_access("x", write=False, label="ub0 reads x")

    def other():
        record_access("y", write=True, label="ub1 writes y")
        dbo_yield()
        record_access("y", write=False, label="ub1 reads y")

    with RaceDetector() as rd:
        run_ubatches([producer, other], device="cpu")
    return rd.races()


@pytest.mark.parametrize("name,prologue,with_wait,without_wait", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_a_removed_wait_is_reported_as_a_race(name, prologue, with_wait, without_wait):
    assert handoff_races(prologue, with_wait) == []
    races = handoff_races(prologue, without_wait)
    assert len(races) == 1, races
    text = str(races[0])
    assert "'x'" in text and "ub0 writes x" in text and "ub0 reads x" in text
    assert "comm" in text and "compute" in text


def test_the_run_joins_the_callers_stream_at_start_and_end():
    streams = STREAM_POOL.get("cpu")

    def on_comm():
        dbo_switch_to_comm()
        record_access("in", write=False, label="comm reads the caller's input")
        record_access("out", write=True, label="comm writes the output")

    with RaceDetector() as rd:
        record_access("in", write=True, label="caller writes the input")
        run_ubatches([on_comm, dbo_yield], device="cpu")
        assert streams.current() is streams.default_stream
        record_access("out", write=False, label="caller reads the output")
    assert rd.races() == [], rd.report()


def test_deferred_switch_outside_a_run_is_a_no_op():
    wait = dbo_switch_to_compute_deferred()
    assert wait() is None


def test_streams_and_events_are_created_once_and_reused():
    seen = []

    def fn():
        ctx = dbo_current_context()
        seen.append((ctx.compute_stream, ctx.comm_stream, ctx.compute_done_event, ctx.comm_done_event))

    for _ in range(2):
        run_ubatches([fn, fn], device="cpu")
    first, second = seen[:2], seen[2:]
    assert all(a is b for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))
    (compute, comm, ev0, ev1), (_, comm_b, ev2, ev3) = first
    assert compute is STREAM_POOL.get("cpu").current() and comm is not compute and comm is comm_b
    assert len({id(ev0), id(ev1), id(ev2), id(ev3)}) == 4  # each ubatch has its own two events


def test_the_detector_sees_a_stream_that_was_never_joined():
    streams = STREAM_POOL.get("cpu")
    caller = streams.current()
    stray = LogicalStream("stray")
    with RaceDetector() as rd:
        record_access("z", write=True, label="caller writes z")
        streams.set_current(stray)
        try:
            record_access("z", write=False, label="stray reads z")
        finally:
            streams.set_current(caller)
    assert len(rd.races()) == 1


# ---- the stand-in against a reachability model ---------------------------------------------

N_STREAMS, N_EVENTS = 3, 2

stream_ops = st.one_of(
    st.tuples(st.just("access"), st.integers(0, N_STREAMS - 1), st.sampled_from("ab"), st.booleans()),
    st.tuples(st.just("record"), st.integers(0, N_EVENTS - 1), st.integers(0, N_STREAMS - 1)),
    st.tuples(st.just("wait"), st.integers(0, N_STREAMS - 1), st.integers(0, N_EVENTS - 1)),
)


def reference_races(ops) -> set[tuple[int, int]]:
    """Races by graph reachability: program order per stream, plus an edge from an event's
    latest record to each wait on it (a wait before any record orders nothing)."""
    edges: dict[int, set[int]] = {}
    last_on: dict[int, int] = {}
    last_record: dict[int, int] = {}
    accesses = []
    for i, op in enumerate(ops):
        stream = op[1] if op[0] in ("access", "wait") else op[2]
        edges.setdefault(i, set())
        if stream in last_on:
            edges[last_on[stream]].add(i)
        last_on[stream] = i
        if op[0] == "record":
            last_record[op[1]] = i
        elif op[0] == "wait" and op[2] in last_record:
            edges[last_record[op[2]]].add(i)
        elif op[0] == "access":
            accesses.append((i, op))

    def reaches(a: int, b: int) -> bool:
        todo, seen = [a], set()
        while todo:
            x = todo.pop()
            if x == b:
                return True
            for y in edges.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return False

    races = set()
    for k, (i, a) in enumerate(accesses):
        for j, b in accesses[k + 1:]:
            if a[1] != b[1] and a[2] == b[2] and (a[3] or b[3]) and not reaches(i, j):
                races.add((i, j))
    return races


@given(st.lists(stream_ops, max_size=24))
def test_stand_in_happens_before_matches_reachability(ops):
    streams = STREAM_POOL.get("cpu")
    caller = streams.current()
    logical = [LogicalStream(f"s{i}") for i in range(N_STREAMS)]
    events = [LogicalEvent(f"e{i}") for i in range(N_EVENTS)]
    with RaceDetector() as rd:
        try:
            for i, op in enumerate(ops):
                note(f"{i}: {op}")
                if op[0] == "access":
                    streams.set_current(logical[op[1]])
                    record_access(op[2], write=op[3], label=str(i))
                elif op[0] == "record":
                    events[op[1]].record(logical[op[2]])
                else:
                    logical[op[1]].wait_event(events[op[2]])
        finally:
            streams.set_current(caller)
    found = {(int(r.first.label), int(r.second.label)) for r in rd.races()}
    assert found == reference_races(ops)
