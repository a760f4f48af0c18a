"""``python -m dbo.bench hf-load`` as a user runs it: a tiny checkpoint written by one process,
then loaded whole and expert-parallel, each on 2 fresh torchrun ranks of its own (the command
measures each rank's memory from its start), in a subprocess on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_hf_load_smoke(tmp_path):
    # a tiny checkpoint written by one process, loaded whole and expert-parallel on 2 ranks each
    out_json = tmp_path / "load.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = subprocess.run([sys.executable, "-m", "dbo.bench", "hf-load", "--dir", str(tmp_path / "ckpt"),
                           "--preset", "tiny-qwen3_moe", "--check", "--json", str(out_json)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.strip().splitlines()[-1].startswith(
        "hf-load: PASS: every ep rank holds 1/2 of the routed experts and its DBOPrefill gathered nothing; "
        "DBO logits match the plain model's"), out
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted((r["mode"], r["rank"]) for r in rows) == [("ep", 0), ("ep", 1), ("plain", 0), ("plain", 1)]
    assert all(r["logits_match"] for r in rows if r["mode"] == "ep"), rows
