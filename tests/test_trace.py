"""The schedule trace: Chrome JSON is well formed, and one canonical schedule is golden.

Structure (what Perfetto needs to draw it right): valid JSON; every track named by a
``thread_name`` metadata event and the process by ``process_name``; on every track, each
``E`` closes an open ``B`` and nothing stays open; timestamps never decrease on a track. Checked
for random programs (regions around each ubatch body, failures included) and for a run that
fails with a region left open. The trace's resumes and unwinds must also come in the order the
model predicts.

The golden timeline lives in ``tests/golden/trace_canonical_2ub.txt``; after a deliberate
change of the schedule or of the trace format, regenerate it with
``DBO_UPDATE_GOLDEN=1 pytest tests/test_trace.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given

from dbo import (
    Trace,
    UBatchError,
    dbo_maybe_run_recv_hook,
    dbo_region,
    dbo_register_recv_hook,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo.testing.model import Case, predict
from dbo.testing.programs import cases, check_case

GOLDEN = Path(__file__).parent / "golden" / "trace_canonical_2ub.txt"


def chrome_problems(doc: dict) -> list[str]:
    """Everything structurally wrong with a Chrome trace document (empty if nothing)."""
    doc = json.loads(json.dumps(doc, allow_nan=False))
    events = doc["traceEvents"]
    problems = []
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
             and e["args"].get("name")}
    if not any(e["ph"] == "M" and e["name"] == "process_name" for e in events):
        problems.append("no process_name metadata")
    open_: dict[int, list[str]] = {}
    last_ts: dict[int, float] = {}
    for i, e in enumerate(events):
        if e["ph"] == "M":
            continue
        tid, ts = e["tid"], e["ts"]
        if tid not in named:
            problems.append(f"event {i}: track {tid} has no thread_name")
        if not isinstance(ts, (int, float)) or ts < last_ts.get(tid, float("-inf")):
            problems.append(f"event {i}: timestamp {ts} goes back on track {tid}")
        last_ts[tid] = ts
        if e["ph"] == "B":
            if not e.get("name"):
                problems.append(f"event {i}: B without a name")
            open_.setdefault(tid, []).append(e.get("name"))
        elif e["ph"] == "E":
            if not open_.get(tid):
                problems.append(f"event {i}: E with no open B on track {tid}")
            else:
                open_[tid].pop()
        elif e["ph"] == "i":
            if e.get("s") not in ("t", "p", "g"):
                problems.append(f"event {i}: instant without scope")
        else:
            problems.append(f"event {i}: unexpected phase {e['ph']!r}")
    problems += [f"track {tid}: {names} never closed" for tid, names in open_.items() if names]
    return problems


@given(cases())
def test_chrome_trace_of_random_programs_is_well_formed(case: Case):
    trace = Trace()
    check_case(case, trace=trace, regions=True)
    doc = trace.to_chrome()
    assert chrome_problems(doc) == [], trace.text()
    # The trace shows the ubatches resumed and unwound in the order the model predicts, and
    # each hook run by the ubatch the model says, for the registrant the model says.
    pred = predict(case)
    traced = [(e.kind, e.ubatch) for e in trace.events if e.kind in ("resume", "unwind")]
    assert traced == list(pred.schedule), trace.text()
    hooks = [(e.ubatch, int(e.detail)) for e in trace.events if e.kind == "hook_begin"]
    assert hooks == [(e.ub, int(re.match(r"\d+", e.name).group())) for e in pred.events
                     if e.kind == "hook"], trace.text()


def test_failing_run_closes_its_regions(tmp_path):
    def left_open():
        dbo_region("never exited").__enter__()  # a region a failure leaves open
        dbo_yield()
        raise ValueError("boom")

    def victim():
        with dbo_region("outer"), dbo_region("inner"):
            dbo_yield()
            dbo_yield()

    trace = Trace()
    with pytest.raises(UBatchError):
        run_ubatches([left_open, victim, dbo_yield], device="cpu", trace=trace)
    kinds = [(e.kind, e.ubatch, e.detail) for e in trace.events]
    assert ("region_end", 0, "never exited") in kinds and ("region_end", 1, "inner") in kinds
    assert kinds[-1][0] == "run_end"
    path = trace.write_chrome(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    assert chrome_problems(doc) == [], trace.text()


def test_trace_of_two_runs_is_well_formed():
    trace = Trace()
    for _ in range(2):
        run_ubatches([dbo_yield, dbo_yield], device="cpu", trace=trace)
    assert chrome_problems(trace.to_chrome()) == []
    assert [e.kind for e in trace.events].count("run_begin") == 2


def canonical_schedule() -> str:
    """Two ubatches: regions, a yield, a recv hook, sync stream switches, both finish."""

    def ub0():
        with dbo_region("attn"):
            pass
        dbo_switch_to_comm_sync()
        with dbo_region("dispatch"):
            dbo_register_recv_hook(lambda: None)
            dbo_yield()
        dbo_switch_to_compute_sync()
        with dbo_region("experts"):
            pass

    def ub1():
        with dbo_region("attn"):
            dbo_maybe_run_recv_hook()
        dbo_yield_and_switch_from_compute_to_comm()
        dbo_switch_to_compute_sync()

    trace = Trace()
    run_ubatches([ub0, ub1], device="cpu", trace=trace)
    assert chrome_problems(trace.to_chrome()) == []
    return trace.text() + "\n"


def test_canonical_schedule_matches_the_golden_timeline():
    text = canonical_schedule()
    if os.environ.get("DBO_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        f"the canonical schedule changed; if that is intended, regenerate {GOLDEN.name} with "
        f"DBO_UPDATE_GOLDEN=1 and review the diff.\nnow:\n{text}")
