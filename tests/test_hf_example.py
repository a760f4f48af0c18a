"""The README's transformers command: ``torchrun --nproc-per-node 2 examples/hf_moe.py`` (CPU,
gloo, tiny config) as a subprocess: it exits 0 (DBO logits == plain logits), prints the table
and writes JSON whose rows say the same, for the naive and all2all backends and the
unconverted model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_moe.py"


def test_hf_example_on_cpu(tmp_path):
    out_json = tmp_path / "hf.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--preset", "tiny-deepseek_v3", "--shape", "3x8", "--steps", "1",
           "--warmup", "0", "--logits-to-keep", "0", "--unconverted", "--json", str(out_json),
           "--expert-schedule", "split", "auto", "--tune-sm-carveout", "none", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "| backend | batch x seq | plain ms | DBO ms |" in out, out
    rows = json.loads(out_json.read_text())["rows"]
    labels = [r["backend"] for r in rows]
    assert labels[::2] == ["all2all/split", "copy_engine/split", "naive/split", "unconverted"], labels
    for label, r in zip(labels[:-1], rows[:-1], strict=True):
        if label.endswith("/split"):
            assert r["split"].startswith("split("), r
            continue
        # the autotune's row: its choice among plain, split and merged, each timed at this shape
        choice = r["autotune"]["choice"]
        assert label == f"{label.split('/')[0]}/auto ({choice})" and choice in ("plain", "split", "merged"), r
        assert r["autotune"]["plain_ms"] > 0 and r["autotune"]["sm_carveout"] in (None, 0), r
        assert r["split"].startswith("plain" if choice == "plain" else "split("), r
    for r in rows:
        assert r["rel_err"] <= 1e-4 and r["top1_agree"] == 1.0, r


def test_hf_example_loads_a_checkpoint(tmp_path):
    # --save-checkpoint writes a tiny Mixtral (every rank its share); --checkpoint loads it
    # expert-parallel through from_pretrained with dbo's backends as transformers' EP
    # implementations, both experts choices, under a simulated link
    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    pytest.importorskip("accelerate")
    out_json = tmp_path / "ckpt.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--preset", "tiny-mixtral", "--save-checkpoint", str(tmp_path / "ckpt"),
           "--backend", "all2all", "copy_engine", "--shape", "3x8", "--steps", "1", "--warmup", "0",
           "--logits-to-keep", "0", "--unconverted", "--json", str(out_json),
           "--ep-experts", "library", "model", "--link", "1000,2000", "--remote-fraction", "0.875"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "(loaded expert-parallel)" in out, out
    result = json.loads(out_json.read_text())
    assert result["checkpoint"] == str(tmp_path / "ckpt")
    rows = result["rows"]
    assert [r["backend"] for r in rows] == [f"{b} ({e} experts)" for e in ("library", "model")
                                            for b in ("all2all", "copy_engine")] + ["unconverted"]
    for r in rows:  # DBO == plain per backend; the whole model == the expert-parallel one
        assert r["rel_err"] <= 1e-4 and r["top1_agree"] == 1.0, r
    # under the simulated link (2 ms a transfer, a dispatch and a combine per layer)
    assert "simulated link: 1000 GB/s, 2000 us latency" in out, out
    layers = result["layers"]
    assert all(r["plain_ms"] >= 2 * 2.0 * layers for r in rows[:-1]), rows


def test_hf_generate_example_agrees_with_generate(tmp_path):
    # greedy decoding: transformers' generate() with its own all_to_all EP, then dbo's
    # greedy_generate on a backend and on a prefill/decode pair, plain and overlapped; float32,
    # so every run's tokens agree
    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    pytest.importorskip("accelerate")
    out_json = tmp_path / "gen.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE.parent / "hf_generate.py"), "--save-checkpoint", str(tmp_path / "ckpt"),
           "--steps", "1", "--warmup", "0", "--backend", "all2all", "copy_engine/all2all",
           "--json", str(out_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["run"] for r in rows] == ["transformers generate (all_to_all)"] + [
        f"dbo greedy_generate {b} {m}" for b in ("all2all", "copy_engine/all2all")
        for m in ("plain", "DBO prefill", "DBO")]
    assert all(r["same"] == 1.0 and r["prefix"] == 1.0 and r["tok_s"] > 0 for r in rows), rows
    assert all(r["prefill_ms"] > 0 for r in rows), rows
    assert all(r["same_plain"] == 1.0 and r["prefix_plain"] == 1.0 for r in rows[1:]), rows
    assert all(r["split"].startswith("split(") for r in rows[1:] if "DBO" in r["run"]), rows
