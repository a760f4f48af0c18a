"""A dead, stalled or slow peer of a DeepEP backend: every survivor gets a named, bounded error
(or, for a slow peer, the right output), on CPU with the fake ``deep_ep`` over gloo.

The same fault harness (:mod:`dbo.testing.faults`) runs on a GPU in
``tests/gpu/run_deepep_faults.py``. Here the data moves inside the fake's launch, so every case
ends in the host-side arrival check; the GPU watchdog is tested in ``tests/test_watchdog.py``.
The last test runs that script itself (``--fake``) at 4 ranks.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from dbo.testing.fake_deep_ep import ensure_fake_deep_ep
from dbo.testing.faults import FAULT_EXIT_CODE, check_survivor, faulty_step
from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(90),
              pytest.mark.dist_world(kill_on_close=True)]

TIMEOUT_S = 1.5
PHASE = {"exit_before_dispatch": "dispatch", "stall": "dispatch", "exit_before_combine": "combine",
         "exit_after_send": "combine"}


def _job(kind: str, fault: str, use_dbo: bool, fail_rank: int) -> dict:
    ensure_fake_deep_ep("v1")
    return faulty_step(kind, fault, use_dbo, fail_rank, TIMEOUT_S, device="cpu", tokens=16)


@pytest.mark.parametrize("kind, fault, use_dbo, fail_rank", [
    ("ht", "exit_before_dispatch", True, 1),
    ("ht", "exit_before_combine", False, 0),
    ("ht", "stall", True, 0),
    ("ll", "exit_before_dispatch", False, 1),
    # (under DBO the fake's receive is a gloo wait that needs the peer: GPU only)
    ("ll", "exit_after_send", False, 1),
    ("ll", "exit_before_combine", True, 0),
    ("ll", "stall", False, 1),
])
def test_dead_or_stalled_peer_is_a_named_bounded_error(world2, kind, fault, use_dbo, fail_rank):
    t0 = time.monotonic()
    try:
        outcomes = world2.run_outcomes(_job, kind, fault, use_dbo, fail_rank, timeout_s=45)
    finally:
        world2.restart()
    chain = check_survivor(outcomes[1 - fail_rank], use_dbo=use_dbo, timeout_s=TIMEOUT_S)
    assert chain[-1][0] == "CollectiveTimeoutError", chain
    msg = chain[-1][1]
    # serial: the very launch the peer never reached; under DBO the other ubatch's next launch
    # may come first in the schedule
    phase = PHASE[fault] if not use_dbo else "(dispatch|combine)"
    phase += " send" if kind == "ll" and use_dbo else ""
    ubatch = "0" if not use_dbo else "[01]"
    assert re.match(f"deepep_{kind} {phase} of ubatch {ubatch} on rank {1 - fail_rank}: "
                    f"rank {fail_rank} did not arrive within {TIMEOUT_S:.1f} s", msg), msg
    failed = outcomes[fail_rank]
    if fault == "stall":
        # the stalled rank comes back, finds the survivor gone, and fails the same way
        assert failed.ok and not failed.value["ok"], failed
        assert failed.value["chain"][-1][0] == "CollectiveTimeoutError"
        assert f"rank {1 - fail_rank} did not arrive" in failed.value["chain"][-1][1]
    else:
        assert failed.exitcode == FAULT_EXIT_CODE, failed
        assert "process exited" in msg, msg
    assert time.monotonic() - t0 < 60  # about 2-6 s with the restart


@pytest.mark.parametrize("kind, use_dbo", [("ht", True), ("ll", False)])
def test_slow_peer_within_the_timeout_is_no_false_alarm(world2, kind, use_dbo):
    for res in world2.run(_job, kind, "slow", use_dbo, 1, timeout_s=45):
        assert res["ok"], res["chain"]
        # the overlapped or plain step against the plain reference step of the same inputs
        assert res["rel_err"] < 1e-2, res


RUNNER = Path(__file__).parent / "gpu" / "run_deepep_faults.py"
#: the script's own run at 4 ranks: two cases, one at a time, each about 8-20 s on 2 loaded cores
EXPECTED_RUN_S = 40


@pytest.mark.timeout(3 * EXPECTED_RUN_S)
def test_fault_table_at_four_ranks_every_survivor_names_the_last_rank(tmp_path):
    out = tmp_path / "faults.json"
    # the runner forked from the preloaded launcher forks its ranks from itself
    argv = [str(RUNNER), "--fork-ranks", "--fake", "--nproc", "4", "--timeout",
            str(TIMEOUT_S), "--backends", "ht", "--modes", "dbo", "--only", "exit_before_dispatch", "slow",
            "--parallel", "1", "--json", str(out)]
    proc = run_entry(argv, cwd=tmp_path, timeout=2.5 * EXPECTED_RUN_S,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), log
    table = json.loads(out.read_text())
    assert table["nproc"] == 4 and "4 ranks" in proc.stdout, log
    rows = {r["fault"]: r for r in table["cases"]}
    assert sorted(rows) == ["exit_before_dispatch", "slow"], log
    dead = rows["exit_before_dispatch"]
    assert dead["peer_exit"] == FAULT_EXIT_CODE, log
    assert [s["rank"] for s in dead["survivors"]] == [0, 1, 2], log
    for s in dead["survivors"]:
        case = f"survivor {s}\n{log}"
        assert s["outcome"] == "raised CollectiveTimeoutError", case
        # the misbehaving rank among the missing (a survivor that gave up first may be named too)
        missing = re.search(r"ranks? ([\d, ]+) did not arrive within", s["message"])
        assert s["message"].startswith("deepep_ht ") and missing, case
        assert "3" in missing.group(1).split(", "), case
        assert s["time_to_error_s"] < 10 * TIMEOUT_S, case  # about TIMEOUT_S; 10x for a loaded machine
    assert dead["time_to_error_s"] == max(s["time_to_error_s"] for s in dead["survivors"]), log
    # a slow peer within the timeout: every rank's overlapped step against its plain reference
    slow = rows["slow"]
    assert slow["passed"] and slow["rel_err"] < 1e-2, log
