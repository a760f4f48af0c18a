"""``python -m dbo.bench hf-load`` as a user runs it: a tiny checkpoint written by one process,
then loaded whole and expert-parallel, each on 2 fresh torchrun ranks of its own (the command
measures each rank's memory from its start), on CPU (gloo). The command itself runs forked from
the preloaded launcher (dbo.testing.launch): its torchrun runs and their ranks are the fresh
processes that the command starts, as for a user."""

from __future__ import annotations

import json
import os

import pytest

from dbo.testing.launch import run_entry

pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
pytest.importorskip("accelerate")

#: the command's bound: it is about 50 s of CPU (two torchrun agents and four ranks, each a fresh
#: interpreter importing torch and transformers), which on 2 cores shared with the suite's other
#: worker and other work gets a fraction of a core; 150 s was passed in a run beside other test runs
RUN_LIMIT_S = 270

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(RUN_LIMIT_S + 30)]


def test_hf_load_smoke(tmp_path):
    # a tiny checkpoint written by one process, loaded whole and expert-parallel on 2 ranks each
    out_json = tmp_path / "load.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = run_entry(["-m", "dbo.bench", "hf-load", "--dir", str(tmp_path / "ckpt"), "--preset",
                      "tiny-qwen3_moe", "--check", "--json", str(out_json)],
                     cwd=tmp_path, env=env, timeout=RUN_LIMIT_S)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.strip().splitlines()[-1].startswith(
        "hf-load: PASS: every ep rank holds 1/2 of the routed experts and its DBOPrefill gathered nothing; "
        "DBO logits match the plain model's"), out
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted((r["mode"], r["rank"]) for r in rows) == [("ep", 0), ("ep", 1), ("plain", 0), ("plain", 1)]
    assert all(r["logits_match"] for r in rows if r["mode"] == "ep"), rows
