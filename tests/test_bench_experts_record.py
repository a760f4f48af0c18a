"""``python -m dbo.bench experts``'s record: the ``--json`` document, read back, writes the same
JSON, with the keys (and their order) it has always had."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dbo.bench.experts.command import add_limits, format_rows, run_grid
from dbo.bench.experts.record import ExpertsResult, ExpertsRow, ImplTiming, limit_summary
from dbo.bench.limits import DeviceLimits
from dbo.experts import SwiGLUExperts

TIMING_KEYS = ["median_ms", "p10_ms", "p90_ms", "rel_err", "host_ms"]
ROW_KEYS = ["layout", "hidden", "intermediate", "local_experts", "tokens", "local_pairs", "experts_with_rows",
            "results"]


def _timing(ms: float, err: float = 0.0) -> ImplTiming:
    return ImplTiming(median_ms=ms, p10_ms=ms * 0.9, p90_ms=ms * 1.2, rel_err=err, host_ms=ms / 4)


def _rows() -> list[ExpertsRow]:
    std = ExpertsRow(layout="standard", hidden=7168, intermediate=2048, local_experts=32, tokens=4096,
                     local_pairs=4100, experts_with_rows=32,
                     results={"library, offsets": _timing(0.5), "unfused, offsets": _timing(0.8, 1e-3)})
    batched = ExpertsRow(layout="batched", hidden=7168, intermediate=2048, local_experts=8, tokens=64,
                         local_pairs=130, experts_with_rows=8,
                         results={"library, offsets": _timing(0.1), "unfused, offsets": _timing(0.2, 2e-3)},
                         ranks=2, capacity=128)
    return [std, batched]


@pytest.mark.parametrize("held", [None, 600.0])
def test_the_record_round_trips_to_the_same_json(held):
    limits = DeviceLimits("H200", copy_gbps=4000.0, gemm_tflops=700.0, held_gemm_tflops=held,
                          instance="GPU-0-1-2-3-4")
    result = ExpertsResult(limits, add_limits(_rows(), limits))
    doc = json.loads(json.dumps(result.to_json()))
    assert list(doc) == ["limits", "rows", "summary"]
    assert doc["limits"] == limits.as_dict()
    again = ExpertsResult.from_json(doc)
    assert json.loads(json.dumps(again.to_json())) == doc and again.to_json() == result.to_json()
    # a row keeps its keys, in their order: the batched one's ranks and capacity, the held limit
    # only where the held GEMM rate was measured
    limit_keys = ["limit_ms", "limit_bound"] + (["held_limit_ms"] if held else [])
    std, batched = doc["rows"]
    assert list(std) == ROW_KEYS + limit_keys
    assert list(batched) == ROW_KEYS + ["ranks", "capacity"] + limit_keys
    assert batched["ranks"] == 2 and batched["capacity"] == 128 and batched["layout"] == "batched"
    timing = std["results"]["library, offsets"]
    assert list(timing) == TIMING_KEYS + ["x_limit"] + (["x_held"] if held else [])
    assert timing["x_limit"] == pytest.approx(0.5 / std["limit_ms"])
    assert list(std["results"]) == ["library, offsets", "unfused, offsets"]
    assert std["limit_bound"] in ("flops", "bytes")
    # the summary is the rows' ratios to the limit
    summary = doc["summary"]["library, offsets"]
    assert list(summary) == ["geomean_x_limit", "worst_x_limit"] + (["geomean_x_held"] if held else [])
    xs = [r["results"]["library, offsets"]["x_limit"] for r in doc["rows"]]
    assert summary["worst_x_limit"] == max(xs)
    assert summary["geomean_x_limit"] == pytest.approx((xs[0] * xs[1]) ** 0.5)
    assert result.worst_rel_err == 2e-3 and result.names == ["library, offsets", "unfused, offsets"]
    # the table reads the record and the record read back alike
    assert format_rows(again.rows, "library, offsets") == format_rows(result.rows, "library, offsets")


def test_rows_without_limits_write_no_limit_keys():
    rows = _rows()
    assert [list(r.to_json()) for r in rows] == [ROW_KEYS, ROW_KEYS + ["ranks", "capacity"]]
    assert list(rows[0].to_json()["results"]["library, offsets"]) == TIMING_KEYS
    assert limit_summary(rows) == {} and limit_summary([]) == {}
    assert ExpertsRow.from_json(rows[1].to_json()) == rows[1]
    empty = ExpertsResult(DeviceLimits("cpu", copy_gbps=10.0, gemm_tflops=0.1))
    assert empty.to_json()["rows"] == [] and empty.worst_rel_err == 0.0 and empty.names == []
    assert ExpertsResult.from_json(empty.to_json()) == empty


def test_the_grid_makes_records_that_round_trip():
    impls = {"a": (SwiGLUExperts(use_triton=False), False), "b": (SwiGLUExperts(use_triton=False), True)}
    rows = run_grid(impls, hidden=[32], intermediate=[16], tokens=[4, 12], local_experts=[4], topk=3,
                    steps=2, dtype=torch.float32, device="cpu", layout="batched", ranks=2)
    limits = DeviceLimits("cpu", copy_gbps=10.0, gemm_tflops=0.1)
    result = ExpertsResult(limits, add_limits(rows, limits, dtype_bytes=4))
    assert all(isinstance(r, ExpertsRow) and isinstance(r.results["a"], ImplTiming) for r in result.rows)
    doc = json.loads(json.dumps(result.to_json()))
    assert ExpertsResult.from_json(doc).to_json() == result.to_json()
    assert list(doc["rows"][0]) == ROW_KEYS + ["ranks", "capacity", "limit_ms", "limit_bound"]


def test_a_run_of_the_idle_timing_alone_compares_against_its_first_timing(monkeypatch, capsys):
    # `--timing idle` alone: every result is named "NAME, from idle", and the table and the verdict
    # compare against the first of those (the GPU's part replaced: this checks what main reads)
    from dbo.bench.experts import command

    limits = DeviceLimits("H200", copy_gbps=4000.0, gemm_tflops=700.0)
    asked = {}

    def grid(impls, **kw):
        asked.update(kw)
        return [dataclasses.replace(r, results={f"{k}{command.IDLE_SUFFIX}": v for k, v in r.results.items()})
                for r in _rows()]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    monkeypatch.setattr(command, "measure_device_limits", lambda **kw: limits)
    monkeypatch.setattr(command, "run_grid", grid)
    assert command.main(["--timing", "idle", "--baseline-only"]) == 0
    out = capsys.readouterr().out
    assert tuple(asked["timings"]) == ("idle",)
    assert "library, offsets, from idle at " in out and "PASS" in out, out
