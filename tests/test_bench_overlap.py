"""The overlap benchmark (examples/bench_overlap.py): its chunked experts against the trusted
reference, and a torchrun smoke run on gloo whose JSON bundle must have the documented
structure (the GPU numbers themselves come from the GPU host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dbo.moe import (
    ActivationFormat,
    LocalPrepareAndFinalize,
    MoEKernel,
    reference_moe,
    relative_error,
    topk_route,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPT = EXAMPLES / "bench_overlap.py"
sys.path.insert(0, str(EXAMPLES))

from _bench_layer import ChunkedSwiGLUExperts  # noqa: E402 - examples/ is not a package


def _case(m=24, hidden=32, inter=16, experts=8, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = topk_route(torch.randn(m, experts, generator=g), topk)
    ids[0, 0] = -1  # a slot routed nowhere
    return x, w1, w2, weights, ids


@pytest.mark.parametrize("fmt,reduce", [(ActivationFormat.STANDARD, "gather"),
                                        (ActivationFormat.STANDARD, "index_add"),
                                        (ActivationFormat.BATCHED_EXPERTS, "gather")])
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_chunked_experts_match_reference(fmt, reduce, chunks):
    x, w1, w2, weights, ids = _case()
    ref = reference_moe(x, w1, w2, weights, ids)
    experts = ChunkedSwiGLUExperts(chunks, reduce=reduce)
    kernel = MoEKernel(LocalPrepareAndFinalize(fmt, use_async=False), experts)
    out = kernel(x, w1, w2, weights, ids, global_num_experts=w1.shape[0])
    assert relative_error(out, ref) < 1e-5


def test_chunked_experts_no_local_pairs_and_bad_reduce():
    x, w1, w2, weights, ids = _case()
    ids.fill_(-1)
    kernel = MoEKernel(LocalPrepareAndFinalize(ActivationFormat.STANDARD, use_async=False),
                       ChunkedSwiGLUExperts(2))
    out = kernel(x, w1, w2, weights, ids, global_num_experts=w1.shape[0])
    assert out.shape == x.shape and not out.any()
    with pytest.raises(ValueError, match="reduce"):
        ChunkedSwiGLUExperts(reduce="atomic")


def test_batched_row_bound_computes_only_received_rows():
    x, w1, w2, weights, ids = _case()
    ref = reference_moe(x, w1, w2, weights, ids)
    experts = ChunkedSwiGLUExperts(2)
    experts.observe = True
    kernel = MoEKernel(LocalPrepareAndFinalize(ActivationFormat.BATCHED_EXPERTS, use_async=False), experts)
    kernel(x, w1, w2, weights, ids, global_num_experts=w1.shape[0])
    most = int(experts.max_rows_seen.item())
    assert 0 < most < x.shape[0]
    experts.observe, experts.rows = False, most
    out = kernel(x, w1, w2, weights, ids, global_num_experts=w1.shape[0])
    assert relative_error(out, ref) < 1e-5


def _run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bundle"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "dbo bench_overlap: backend=" in proc.stdout, log
    bundle = json.loads((out / "bench_overlap.json").read_text())
    assert bundle["files"]["json"] == "bench_overlap.json"
    trace = json.loads((out / bundle["files"]["trace"]).read_text())["traceEvents"]
    assert {"ub0 running", "ub1 running", "dispatch", "combine"} <= {e.get("name") for e in trace}
    if bundle["files"]["plot"]:
        assert (out / bundle["files"]["plot"]).read_bytes()[:4] == b"\x89PNG"
    return bundle


def _check_structure(bundle: dict, backend: str, chunks: list[int], sms: list[int]) -> None:
    assert bundle["schema"] == "dbo.bench_overlap/1" and bundle["partial"] is False
    assert bundle["env"]["world_size"] == 2 and bundle["env"]["torch"] == torch.__version__
    assert bundle["args"]["backend"] == backend and bundle["args"]["steps"] >= 1
    assert bundle["shapes"], "no shapes measured"
    for sh in bundle["shapes"]:
        assert {"tokens", "intermediate", "layers", "measurements", "checks", "summary", "plan"} <= sh.keys()
        assert sh["plan"].startswith("split(")
        got = {(m["mode"], m["expert_chunks"], m["num_sms"]) for m in sh["measurements"]}
        s_or_none = sms or [None]
        want = ({("compute", c, None) for c in chunks} | {("dbo_compute", c, None) for c in chunks}
                | {("comm", None, s) for s in s_or_none}
                | {(mode, c, s) for mode in ("serial", "dbo") for c in chunks for s in s_or_none}
                | {("wrapper", None, None), ("serial_paired", None, None)})
        assert got == want
        for m in sh["measurements"]:
            t = m["timing"]
            assert len(t["step_ms"]) == bundle["args"]["steps"]
            assert 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
            assert t["cpu_launch_ms"] > 0
        # every DBO and chunked output was checked against the serial one, and matched
        checked = {"dbo_vs_serial", "wrapper", *(f"dbo_c{c}_s{s}" for c in chunks for s in s_or_none)}
        assert checked <= sh["checks"].keys()
        assert all(v["token_median"] <= 2e-2 for v in sh["checks"].values())
        s = sh["summary"]
        for key in ("compute_ms", "comm_ms", "serial_ms", "dbo_ms", "speedup", "efficiency", "comm_share"):
            assert isinstance(s[key], float), key
        assert s["speedup"] == pytest.approx(s["serial_ms"] / s["dbo_ms"])
        hideable = min(s["compute_ms"], s["comm_ms"])
        assert s["efficiency"] == pytest.approx((s["serial_ms"] - s["dbo_ms"]) / hideable)
        assert [r["expert_chunks"] for r in s["per_chunks"]] == chunks
        assert [r["num_sms"] for r in s["per_num_sms"]] == sms
        # the wrapper was timed with the autotuned config, which the autotune section records
        assert s["wrapper_measured"] is True and s["wrapper_config"] == "autotuned"
        # ... against the serial forward timed in alternation with it
        assert s["serial_paired_ms"] > 0
        assert s["wrapper_vs_serial"] == pytest.approx(s["wrapper_ms"] / s["serial_paired_ms"])
        assert s["wrapper_vs_serial_unpaired"] == pytest.approx(s["wrapper_ms"] / s["serial_ms"])
    for inter, tuned in bundle["autotune"].items():
        assert tuned["ok"], tuned
        assert sorted(r["tokens"] for r in tuned["rows"]) == sorted(
            sh["tokens"] for sh in bundle["shapes"] if str(sh["intermediate"]) == inter)
        assert all(r["serial_ms"] > 0 for r in tuned["rows"])
        assert "threshold: split" in tuned["table"]




@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bench_naive_cpu_bundle(tmp_path):
    bundle = _run_bench(tmp_path, "--backend", "naive")
    _check_structure(bundle, "naive", [1, 2], [])
    assert bundle["shapes"][0]["tokens"] == 64


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bench_dbo_sm_carveout_variants(tmp_path):
    bundle = _run_bench(tmp_path, "--backend", "naive", "--expert-chunks", "1",
                        "--dbo-sm-carveout", "none", "4")
    sh = bundle["shapes"][0]
    carve = sorted((m["sm_carveout"] is None, m["sm_carveout"]) for m in sh["measurements"]
                   if m["mode"] == "dbo")
    assert carve == [(False, 4), (True, None)]
    assert {"dbo_c1_sNone", "dbo_c1_sNone_k4"} <= sh["checks"].keys()
    assert all(m["sm_carveout"] is None for m in sh["measurements"] if m["mode"] != "dbo")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend, extra, sms", [
    ("deepep_ht", ["--num-sms", "24", "32"], [24, 32]),
    ("deepep_ll", ["--tokens", "32"], []),
])
def test_bench_deepep_paths_on_fake(tmp_path, backend, extra, sms):
    # the fake deep_ep (dbo.testing) runs the DeepEP code paths of the benchmark on gloo:
    # SM-count switching, record/replay, the low-latency row bound
    bundle = _run_bench(tmp_path, "--backend", backend, "--fake-deep-ep", *extra)
    _check_structure(bundle, backend, [1, 2], sms)
    sh = bundle["shapes"][0]
    if backend == "deepep_ll":
        rows = sh["ll_rows"]
        assert 0 < rows["dbo"] <= rows["serial"] <= 2 * sh["tokens"]
        assert bundle["crossover"][0]["intermediate"] == sh["intermediate"]
    else:
        assert bundle["env"]["deepep_setup"]["deep_ep_default_num_sms"] == 20
