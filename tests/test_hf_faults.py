"""A rank that exits or stalls inside a ``DBOPrefill`` call or a ``greedy_generate`` decode step
of a model loaded expert-parallel with ``dbo_copy_engine``: its peer raises a named dbo error
(``CollectiveTimeoutError``, inside ``UBatchError`` where the step ran as ubatches) naming the
backend, the missing rank and the timeout, and every process exits by itself.

Runs ``tests/gpu/run_hf_faults.py`` (the GPU step ``hffaults``) on CPU: 2 gloo ranks per case,
copy_engine over host shared memory, a tiny Qwen3-MoE checkpoint, the collective timeout
``T``. Each case first checks the fault-free step (DBO against plain). The runner's own target
(the error within ``T + 3`` s, every process gone within ``T + 10`` s) is for GPU hosts; here,
on a loaded 2-core machine, every bound is 10x the time expected.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dbo.testing.faults import FAULT_EXIT_CODE
from dbo.testing.launch import run_entry

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

RUNNER = Path(__file__).parent / "gpu" / "run_hf_faults.py"
TIMEOUT_S = 2.0
# (where, fault): exits and stalls at each phase once, in the prefill and in the decode steps
CASES = [("prefill", "exit_before_dispatch"), ("decode", "exit_after_combine"),
         ("prefill", "stall_before_combine"), ("decode", "stall")]
# seconds from the fault: the survivor's error (T), the last exit (a stalled rank sleeps T + 2,
# then waits T for the peer that left, then tears down: about 2 s of CPU)
EXPECTED_ERROR_S, EXPECTED_EXIT_S = TIMEOUT_S, 3 * TIMEOUT_S + 4
EXPECTED_RUN_S = 35  # 4 cases, 2 at a time, each 10-25 s (mostly imports and loads) on 2 cores

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc,
              pytest.mark.timeout(12 * EXPECTED_RUN_S)]


def test_dead_or_stalled_peer_is_a_named_error_and_no_process_is_left(tmp_path):
    out = tmp_path / "hf_faults.json"
    # the runner forked from the preloaded launcher forks its ranks from itself
    argv = [str(RUNNER), "--fork-ranks", "--device", "cpu", "--timeout",
            str(TIMEOUT_S), "--parallel", "2", "--case-limit", str(10 * EXPECTED_RUN_S), "--json", str(out)]
    for where, fault in CASES:
        argv += ["--case", f"dbo_copy_engine:{where}:{fault}"]
    t0 = time.monotonic()
    proc = run_entry(argv, cwd=tmp_path, timeout=10 * EXPECTED_RUN_S)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), log
    rows = json.loads(out.read_text())["cases"]
    assert [(r["where"], r["fault"]) for r in rows] == CASES, log
    for r in rows:
        case = f"{r['where']} {r['fault']}: {r}\n{log}"
        assert r["reference_ok"], "the fault-free step: DBO != plain, " + case
        assert r["fault_reached"], case
        # the surviving rank: a dbo error, whose innermost cause is the backend's timeout
        assert r["error"] == ("UBatchError" if r["where"] == "prefill" else "CollectiveTimeoutError"), case
        assert r["root"] == "CollectiveTimeoutError", case
        msg = r["message"]
        assert msg.startswith("copy_engine: rank 0 waited") and "rank 1" in msg, case
        if r["fault"].startswith("exit") and "publish" in msg:  # the board saw the process gone
            assert "exited" in msg and r["time_to_error_s"] < TIMEOUT_S, case
        else:
            assert f"{TIMEOUT_S:.1f} s" in msg and "the peer died or fell out of step" in msg, case
        assert r["time_to_error_s"] < 10 * EXPECTED_ERROR_S, case
        # nothing left to kill: every process ended by itself (the runner killed none)
        assert not any(r["killed"]) and max(r["exit_s"]) < 10 * EXPECTED_EXIT_S, case
        survivor, failed = r["exit_codes"]
        assert survivor == 1, case  # it raised, tore down, and left
        # an exiting rank went at the fault; a stalled one came back, found its peer gone, raised too
        stalled = r["fault"].startswith("stall")
        assert failed == (1 if stalled else FAULT_EXIT_CODE), case
        assert r["peer_error"] == ("CollectiveTimeoutError" if stalled else None), case
    assert time.monotonic() - t0 < 10 * EXPECTED_RUN_S
