"""The soak runner of the transformers path (``tests/gpu/run_hf_soak.py``, the GPU step ``soak``)
on CPU: 2 gloo ranks, a tiny Qwen3-MoE checkpoint loaded expert-parallel with ``dbo_all2all``, a
few seconds of ``DBOPrefill`` and ``greedy_generate`` calls of random sizes. The runner checks DBO
against plain once at the start; here every call must succeed and the JSON say so. A failed call
is recorded and the soak goes on (every rank failed it) or stops (one rank only: out of step),
exit status 1 either way. The verdict on memory (CUDA figures, none on the CPU) is held against
made-up calls."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from dbo.testing.launch import run_entry

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

GPU_DIR = Path(__file__).resolve().parent / "gpu"
_SPEC = importlib.util.spec_from_file_location("hf_soak_calls", GPU_DIR / "hf_soak_calls.py")
soak_calls = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = soak_calls  # its dataclass looks its module up there
_SPEC.loader.exec_module(soak_calls)

# each run: about 7 s on 2 cores (imports, a checkpoint of 140 KB, the check, 2 s of calls)
EXPECTED_RUN_S = 8
CALL_FIELDS = {"i", "kind", "batch", "seq", "tokens", "new_tokens", "split", "seconds", "tokens_s",
               "allocated", "reserved", "peak_allocated", "rss_mib", "error", "failed_ranks"}

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(10 * 3 * EXPECTED_RUN_S)]


def _soak(tmp_path: Path, *extra: str) -> tuple[int, str, dict]:
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    argv = [str(GPU_DIR / "run_hf_soak.py"), "--save-checkpoint", str(tmp_path / "ckpt"),
           "--min-len", "8", "--max-len", "48", "--batches", "1", "2", "4", "--new-tokens", "3",
           "--duration-s", "2", "--max-calls", "12", "--warmup-calls", "2", "--timeout-s", "30",
           "--json", str(out), *extra]
    # torchrun's two ranks, forked from a process that has imported torch (dbo.testing.launch)
    proc = run_entry(argv, nproc=2, cwd=tmp_path, env=env, timeout=10 * EXPECTED_RUN_S)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert out.exists(), log
    return proc.returncode, log, json.loads(out.read_text())


@pytest.mark.parametrize("extra", [(), ("--cuda-graph",)], ids=["eager", "static-cache decode"])
def test_soak_on_cpu_every_call_succeeds_and_dbo_matches_plain(tmp_path, extra):
    rc, log, doc = _soak(tmp_path, *extra)
    assert doc["cuda_graph"] is bool(extra), doc["cuda_graph"]
    assert rc == 0, log
    assert "run_hf_soak.py: PASS: " in log, log
    check = doc["check"]
    # the start's check: DBO split the batch and gave the plain run's numbers (float32)
    assert check["ok"] and check["split"], check
    assert check["prefill_rel_err"] <= 1e-5 and check["prefill_top1_agree"] == 1.0, check
    assert check["generate_identical"] == 1.0, check
    calls, summary = doc["calls"], doc["summary"]
    assert 0 < len(calls) == summary["calls"] <= 12, log
    assert summary["errors"] == 0 and doc["stopped"] is None and doc["ok"], summary
    for c in calls:
        assert set(c) == CALL_FIELDS, c
        assert c["error"] is None and c["failed_ranks"] == [] and c["tokens_s"] > 0, c
        assert c["allocated"] is None and c["reserved"] is None, c  # CUDA figures, none on the CPU
        assert len(c["rss_mib"]) == 2 and min(c["rss_mib"]) > 0, c
        assert 8 <= c["seq"] <= 48 and c["batch"] in (1, 2, 4), c
        assert c["split"] == (c["batch"] >= 2), c  # overlapped from 2 sequences on
    # the largest call of each kind opens the soak; then the kinds take turns
    assert [(c["kind"], c["batch"], c["seq"]) for c in calls[:2]] == [("prefill", 4, 48), ("generate", 4, 48)]
    assert [c["kind"] for c in calls] == [("prefill", "generate")[i % 2] for i in range(len(calls))]
    assert summary["memory"]["flat"] is None  # not judged on the CPU
    for kind in ("prefill", "generate"):
        rates = summary["tokens_s"][kind]
        assert rates["calls"] >= 1 and rates["first"] > 0 and rates["last"] > 0, summary


@pytest.mark.parametrize("where", ["3", "3:1"], ids=["every-rank", "one-rank"])
def test_a_failed_call_is_recorded_and_one_rank_alone_stops_the_soak(tmp_path, where):
    rc, log, doc = _soak(tmp_path, "--inject-error", where)
    assert rc == 1, log
    calls, summary = doc["calls"], doc["summary"]
    failed = [c for c in calls if c["failed_ranks"]]
    assert [c["i"] for c in failed] == [3] and summary["errors"] == 1 and not doc["ok"], log
    assert "injected after call 3" in log, log  # the rank that raised printed it
    if where == "3":  # in step: recorded, and the soak went on
        assert failed[0]["failed_ranks"] == [0, 1] and failed[0]["error"][0][0] == "RuntimeError", failed
        assert doc["stopped"] is None and len(calls) > 4, log
        assert doc["why"].startswith("1 of "), doc["why"]
    else:  # rank 1 only: out of step, the soak stopped there (rank 0's own call had succeeded)
        assert failed[0]["failed_ranks"] == [1] and failed[0]["error"] is None, failed
        assert len(calls) == 4 and "out of step" in doc["stopped"], doc["stopped"]
    assert "run_hf_soak.py: FAIL: " in log, log


def _call(i: int, kind: str, allocated: float, reserved: float, *, failed: bool = False) -> dict:
    return {"i": i, "kind": kind, "batch": 2, "seq": 64, "tokens": 128, "new_tokens": 0, "split": True,
            "seconds": 0.1, "tokens_s": 1280.0, "allocated": [allocated, allocated],
            "reserved": [reserved, reserved + 1e6], "peak_allocated": None, "rss_mib": [500.0, 500.0],
            "error": [["RuntimeError", "x"]] if failed else None, "failed_ranks": [0, 1] if failed else []}


def test_the_memory_verdict():
    gib, check = 2**30, {"ok": True, "why": "ok"}
    warmup = [_call(i, "prefill", (20 + i) * gib, 40 * gib) for i in range(3)]  # growth in the warm-up
    flat = warmup + [_call(3 + i, ("prefill", "generate")[i % 2], 30 * gib + i * 1e6, 40 * gib)
                     for i in range(10)]
    summary = soak_calls.summarize(flat, world=2, warmup_calls=3)
    ok, why = soak_calls.soak_verdict(summary, check, None, judge_memory=True)
    assert ok and summary["memory"]["flat"] and summary["measured_calls"] == 10, (why, summary)
    assert summary["memory"]["allocated"]["per_rank"][0]["min"] == 30 * gib
    # 2% more allocated by the end: not flat, and the verdict says by how much
    growing = flat + [_call(13, "prefill", 30.6 * gib, 40 * gib)]
    ok, why = soak_calls.soak_verdict(soak_calls.summarize(growing, world=2, warmup_calls=3), check, None,
                                      judge_memory=True)
    assert not ok and "memory not flat" in why and "allocated 1.9" in why, why
    # a failed call: counted, left out of the memory figures (its memory is not the steady state)
    failing = flat + [_call(13, "generate", 35 * gib, 40 * gib, failed=True)]
    summary = soak_calls.summarize(failing, world=2, warmup_calls=3)
    ok, why = soak_calls.soak_verdict(summary, check, None, judge_memory=True)
    assert not ok and summary["errors"] == 1 and summary["memory"]["flat"], (why, summary)
    # nothing after the warm-up: not judged flat on CUDA, fine on the CPU
    short = soak_calls.summarize(warmup, world=2, warmup_calls=3)
    assert not soak_calls.soak_verdict(short, check, None, judge_memory=True)[0]
    assert soak_calls.soak_verdict(short, check, None, judge_memory=False)[0]


def test_the_calls_are_seeded_and_within_bounds():
    def take(seed: int) -> list:
        it = soak_calls.soak_specs(seed, [1, 2, 8], 64, 4096)
        return [next(it) for _ in range(200)]

    calls = take(7)
    assert calls == take(7) and calls != take(8)  # every rank draws the same sequence
    assert calls[:2] == [soak_calls.CallSpec("prefill", 4096, (0,) * 8),
                         soak_calls.CallSpec("generate", 4096, (0,) * 8)]
    for c in calls:
        assert c.batch in (1, 2, 8) and 64 <= c.seq <= 4096, c
        assert min(c.pads) == 0 and all(c.seq - p >= 64 for p in c.pads), c  # left padding only
    assert {c.batch for c in calls} == {1, 2, 8} and len({c.seq for c in calls}) > 100


def test_first_and_last_tokens_per_second_are_window_totals():
    calls = [{"tokens": 100 * (1 + i % 3), "seconds": 0.1 * (1 + i % 3) * (2 if i >= 90 else 1)}
             for i in range(120)]
    rates = soak_calls.first_last(calls)
    # a tenth of the calls each (12): 1000 tokens/s at the start; the last 12 half as fast after call 90
    assert rates["window"] == 12 and rates["calls"] == 120, rates
    assert abs(rates["first"] - 1000) < 1e-6 and abs(rates["last"] - 500) < 1e-6, rates
    assert soak_calls.first_last(calls[:7])["window"] == 5  # at least 5 calls a window
