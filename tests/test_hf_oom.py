"""The runner of one rank short of memory on the transformers path (``tests/gpu/run_hf_oom.py``,
the GPU step ``hfoom``) on CPU: 2 gloo ranks, a tiny Qwen3-MoE checkpoint loaded expert-parallel
with ``dbo_all2all``. There is no device memory on the CPU, so the short rank's free memory and
its out-of-memory error are stood in for; the split vote, the fallback, the logits against the
plain prefill, the peers' wait and the processes' ends are real."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dbo.testing.launch import run_entry

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

RUNNER = Path(__file__).resolve().parent / "gpu" / "run_hf_oom.py"
EXPECTED_RUN_S = 10  # imports, a checkpoint of 140 KB, a few tiny prefills, one peer's wait

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(10 * EXPECTED_RUN_S)]


def test_a_short_rank_falls_back_with_its_peers_and_ends_named_where_nothing_fits(tmp_path):
    out = tmp_path / "oom.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    # torchrun's two ranks, forked from a process that has imported torch (dbo.testing.launch)
    proc = run_entry([str(RUNNER), "--save-checkpoint", str(tmp_path / "ckpt"), "--timeout", "5",
                      "--json", str(out)], nproc=2, cwd=tmp_path, env=env, timeout=10 * EXPECTED_RUN_S)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "run_hf_oom.py: PASS: 6 of 6 rows passed" in log, log
    rows = {(r["case"], r["rank"]): r for r in json.loads(out.read_text())["rows"]}
    # the whole group ran plainly: the short rank (1) for memory, its peer by the agreement
    for rank, reason in ((0, "disagreement"), (1, "memory")):
        r = rows["fallback", rank]
        assert (r["split"], r["reason"], r["matches"]) == (False, reason, True), r
        assert r["next_split"] and r["next_matches"], r  # usable again, overlapped, once it has room
    # the plain call's need known: every rank named the short one before the call, and the
    # group stayed in step (a call of half the batch ran and matched)
    for rank in (0, 1):
        r = rows["no-room", rank]
        assert r["error"] == "DeviceMemoryError" and "rank 1 is short of device memory" in r["message"], r
        assert r["next_matches"], r
    assert rows["no-room, unmeasured", 1]["root"] == "OutOfMemoryError", rows["no-room, unmeasured", 1]
    peer = rows["no-room, unmeasured", 0]
    assert "CollectiveTimeoutError" in (peer["error"], peer["root"]) and peer["seconds"] <= 5 + 3, peer
