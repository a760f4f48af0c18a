"""What every overlap-benchmark run of the tests must show (``python -m dbo.bench overlap``, see
tests/test_bench_overlap.py and tests/test_bench_overlap_backends.py): the run itself, as torchrun's
ranks or one plain process, and the structure of the JSON bundle it writes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from dbo.bench.cli import legend
from dbo.bench.overlap.report import LIMIT_COLUMNS, LINK_COLUMNS, MAIN_COLUMNS, PLOT_HINT
from dbo.testing.launch import run_entry


def run_bench(tmp_path: Path, *args: str, nproc: int | None = 2) -> dict:
    out = tmp_path / "bundle"
    # torchrun's two ranks, forked from a process that has imported torch (dbo.testing.launch)
    argv = ["-m", "dbo.bench", "overlap", "--device", "cpu", "--quick", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    proc = run_entry(argv, nproc=nproc, cwd=tmp_path, env=env, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "dbo bench_overlap: backend=" in proc.stdout, log
    # the last line: the verdict, naming the folder written
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("python -m dbo.bench overlap: PASS: "), log
    assert last.endswith(f"bundle in {out}/"), log
    # nothing on a CPU run reads as a fault: no rate rounded to 0 (a CPU's GEMM rate is GFLOP/s),
    # no warning (matplotlib is optional, and its own log stays out of the output)
    assert not re.search(r"(?<![\d.])0 [kMGT]?(FLOP|B)/s", proc.stdout), log
    assert "WARNING" not in proc.stdout and "matplotlib" not in proc.stderr, log
    bundle = json.loads((out / "bench_overlap.json").read_text())
    assert bundle["files"]["json"] == "bench_overlap.json"
    trace = json.loads((out / bundle["files"]["trace"]).read_text())["traceEvents"]
    assert {"ub0 running", "ub1 running", "dispatch", "combine"} <= {e.get("name") for e in trace}
    if bundle["files"]["plot"]:
        assert (out / bundle["files"]["plot"]).read_bytes()[:4] == b"\x89PNG"
    else:  # how to get it, in the bundle's line
        assert f"no PNG plot ({PLOT_HINT})" in proc.stdout, log
    # every table's columns are explained in the line under it
    lines = proc.stdout.splitlines()
    for columns in (MAIN_COLUMNS, LIMIT_COLUMNS, LINK_COLUMNS):
        head = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("tokens ") and all(
            part in ln for k in columns for part in k.split(", "))), None)
        assert head is not None or columns is not MAIN_COLUMNS, log  # the others where measured
        if head is not None:  # under its rows, before any other table
            rest = lines[head + 1:]
            end = next((i for i, ln in enumerate(rest) if ln.lstrip().startswith("tokens ")), len(rest))
            assert legend(columns)[0] in rest[:end], log
    return bundle


def check_structure(bundle: dict, backend: str, sms: list[int], extra_modes: tuple[str, ...] = ()) -> None:
    assert bundle["schema"] == "dbo.bench_overlap/2" and bundle["partial"] is False
    assert bundle["env"]["world_size"] == 2 and bundle["env"]["torch"] == torch.__version__
    assert bundle["args"]["backend"] == backend and bundle["args"]["steps"] >= 1
    assert bundle["shapes"], "no shapes measured"
    for sh in bundle["shapes"]:
        assert {"tokens", "intermediate", "layers", "measurements", "checks", "summary", "plan"} <= sh.keys()
        assert sh["plan"].startswith("split(")
        got = {(m["mode"], m["num_sms"]) for m in sh["measurements"]}
        s_or_none = sms or [None]
        want = ({("compute", None), ("dbo_compute", None), ("merged_compute", None), ("wrapper", None),
                 ("serial_paired", None), ("wrapper_untuned", None), ("serial_paired_untuned", None)}
                | {(mode, s) for mode in ("comm", "serial", "dbo", "merged", *extra_modes)
                   for s in s_or_none})
        assert got == want
        for m in sh["measurements"]:
            t = m["timing"]
            assert len(t["step_ms"]) == bundle["args"]["steps"]
            assert 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
            assert t["cpu_launch_ms"] > 0
        # every serial and DBO output was checked against the serial reference, and matched
        checked = {"dbo_vs_serial", "merged_vs_serial", "wrapper",
                   *(f"{mode}_s{s}" for mode in ("serial", "dbo", "merged") for s in s_or_none)}
        assert checked <= sh["checks"].keys()
        assert all(v["token_median"] <= 2e-2 for v in sh["checks"].values())
        s = sh["summary"]
        for key in ("compute_ms", "comm_ms", "serial_ms", "dbo_ms", "speedup", "efficiency", "comm_share",
                    "merged_ms", "merged_compute_ms", "merged_speedup"):
            assert isinstance(s[key], float), key
        assert s["merged_speedup"] == pytest.approx(s["serial_ms"] / s["merged_ms"])
        if not extra_modes:
            assert s["best_schedule"] == min((s["serial_ms"], "plain"), (s["dbo_ms"], "split"),
                                             (s["merged_ms"], "merged"))[1]
        assert s["speedup"] == pytest.approx(s["serial_ms"] / s["dbo_ms"])
        # the compute columns against the hardware limit measured in the same run
        assert bundle["env"]["limits"]["copy_gbps"] > 0 and bundle["env"]["limits"]["gemm_tflops"] > 0
        assert s["limit_ms"] == pytest.approx(sh["limit_ms_per_layer"]["total"]) and s["limit_ms"] > 0
        assert s["compute_x_limit"] == pytest.approx(s["compute_ms"] / s["limit_ms"])
        assert s["merged_compute_over_compute"] == pytest.approx(s["merged_compute_ms"] / s["compute_ms"])
        hideable = min(s["compute_ms"], s["comm_ms"])
        assert s["efficiency"] == pytest.approx((s["serial_ms"] - s["dbo_ms"]) / hideable)
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
        assert "threshold: split" in tuned["table"] and "merged ms" in tuned["table"]
        assert tuned["schedule"] in ("plain", "split", "merged", "sbo")
        assert all(r["merged_ms"] > 0 for r in tuned["rows"])


def check_grouped_modes(shape: dict) -> None:
    for mode in ("sbo", "sbo_dbo"):
        assert any(m["mode"] == mode and m.get("timing") for m in shape["measurements"])
        assert any(k.startswith(f"{mode}_s") for k in shape["checks"]), shape["checks"]
        assert shape["summary"][f"{mode}_ms"] > 0
    assert "sbo_dbo_vs_serial" in shape["checks"]
    assert all(c["token_median"] <= 2e-2 for k, c in shape["checks"].items() if k.startswith("sbo"))
    s = shape["summary"]
    names = (("serial_ms", "plain"), ("dbo_ms", "split"), ("merged_ms", "merged"), ("sbo_ms", "sbo"),
             ("sbo_dbo_ms", "sbo+dbo"))
    timed = [(s[k], name) for k, name in names if s.get(k) is not None]
    assert s["best_schedule"] == min(timed)[1]
