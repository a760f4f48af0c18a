"""The overlap benchmark's options value (bad combinations are a ValueError naming the option)
and its record (the bundle's JSON, read back, writes the same JSON)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dbo.bench.overlap.args import parse_args
from dbo.bench.overlap.options import OverlapOptions
from dbo.bench.overlap.record import (
    SCHEMA,
    AutotuneRecord,
    Check,
    Measurement,
    OverlapResult,
    ShapeRecord,
)
from dbo.bench.overlap.report import format_table
from dbo.bench.overlap.summary import summarize
from dbo.bench.timing import Timing


def _options(**changes) -> OverlapOptions:
    base = OverlapOptions(backend="all2all", device="cpu", dtype="float32", tokens=(64, 256),
                          intermediate=(64,), hidden=128, experts=8, topk=2, attn_width=128, layers=2,
                          steps=3, warmup=1)
    return dataclasses.replace(base, **changes)


def test_the_command_line_builds_the_options_value():
    opts = parse_args(["--device", "cpu", "--backend", "naive", "--tokens", "32", "64",
                       "--dbo-sm-carveout", "none", "4"])
    assert isinstance(opts, OverlapOptions)
    assert opts.tokens == (32, 64) and opts.dbo_sm_carveout == (None, 4) and opts.layout == "naive"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.topk = 3  # type: ignore[misc]
    emulated = parse_args(["--device", "cpu", "--emulate-ep", "16", "--emulate-rank", "3",
                           "--experts", "32", "--hidden", "256"])
    assert emulated.backend == "emulated" and emulated.layout == "deepep_ll" and emulated.decode
    assert dict(emulated.backend_kwargs) == {"ep_size": 16, "rank": 3, "layout": "deepep_ll",
                                             "gpus_per_host": 8}
    assert emulated.ep_group(0, 1) == (3, 16)


@pytest.mark.parametrize("changes, message", [
    (dict(topk=9), "--topk 9: must be <= --experts (8)"),
    (dict(tokens=(64, 1)), "--tokens 1: must be >= 2"),
    (dict(tokens=()), "--tokens and --intermediate"),
    (dict(warmup=-1), "--warmup -1: must be >= 0"),
    (dict(num_sms=(24, 33)), "--num-sms 33: must be even"),
    (dict(sbo_groups=0), "--sbo-groups 0: must be >= 1"),
    (dict(modes=("serial", "nope")), "--modes serial nope"),
    (dict(intermediate=(64, 128), save_config="tuned.json"), "needs one --intermediate"),
    (dict(autotune=False, save_config="tuned.json"), "no --no-autotune"),
    (dict(ll_rows="some"), "--ll-rows 'some'"),
    (dict(profile_shape="64x64"), "--profile-shape '64x64'"),
    (dict(dtype="float16"), "--dtype float16"),
    (dict(backend="nope"), "--backend nope: unknown"),
    (dict(backend="emulated"), "--emulate-ep N"),
    (dict(emulate_ep=16), "leave --backend out"),
    (dict(backend="emulated", emulate_ep=1), "at least 2 ranks"),
    (dict(backend="emulated", emulate_ep=4, emulate_rank=4), "--emulate-rank 4"),
    (dict(backend="emulated", emulate_ep=12), "--gpus-per-host 8"),
    (dict(backend="emulated", emulate_ep=16), "--experts 8 is not a multiple"),
    (dict(backend="emulated", emulate_ep=2, remote_fraction=1.5), "--remote-fraction 1.5"),
    (dict(backend_kwargs={"nope": 1}), "--backend-opt nope: all2all has no such option"),
])
def test_the_options_refuse_what_no_run_can_honour(changes, message):
    with pytest.raises(ValueError) as exc:
        _options(**changes)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)  # one line, as the command line prints it


def _timing(ms: float) -> Timing:
    return Timing(step_ms=[ms, ms], median_ms=ms, p10_ms=ms, p90_ms=ms, cpu_launch_ms=ms / 4,
                  cpu_launch_held_ms=None, held_sleep_ms=None, host_sync=False, cpu_bound=False,
                  launch_ratio=0.25, peak_bytes=1000, peak_extra_bytes=10, notes=[])


def _result() -> OverlapResult:
    opts = _options(link="50,5", remote_fraction=0.5, out="/tmp/somewhere/out")
    shape = ShapeRecord(backend="all2all", tokens=64, intermediate=64, shared_intermediate=64, layers=2)
    for mode, ms in (("compute", 2.0), ("dbo_compute", 2.2), ("comm", 1.0), ("serial", 3.0),
                     ("dbo", 2.4), ("merged", 2.6)):
        shape.measurements.append(Measurement(mode, timing=_timing(ms)))
    shape.measurements.append(Measurement("dbo", sm_carveout=4, skipped="time budget"))
    shape.measurements.append(Measurement("wrapper", timing=_timing(2.5), rounds=3))
    shape.checks["dbo_vs_serial"] = Check(1e-6, 2e-7)
    shape.limit_ms_per_layer = {"attention": 0.1, "total": 0.5}
    shape.flops_per_token_per_layer = {"attention": 1.0}
    shape.comm_bytes_per_layer = 4096.0
    shape.plan = "split(32+32)"
    shape.cuda_graph = {"ok": False, "error": "--cuda-graph needs --device cuda"}
    shape.online_choice = {"chose": "split", "table": "..."}
    shape.summary = summarize(shape, True, wrapper_config="autotuned")
    result = OverlapResult(opts, {"world_size": 2, "device_name": "cpu", "dbo_disabled": False},
                           shapes=[shape], warnings=["w"], files={"json": "bench_overlap.json", "plot": None})
    result.autotune[64] = AutotuneRecord(ok=True, decode_only=False, threshold=64, schedule="split",
                                         never_split=False, margin=0.02, rows=({"tokens": 64},),
                                         table="threshold: split 64")
    return result


def test_the_record_round_trips_to_the_same_json():
    doc = json.loads(json.dumps(_result().to_json()))
    assert doc["schema"] == SCHEMA
    again = OverlapResult.from_json(doc)
    assert json.loads(json.dumps(again.to_json())) == doc
    # what the readers of bundles ask for keeps its keys and types
    sh = doc["shapes"][0]
    assert {"tokens", "intermediate", "layers", "measurements", "checks", "summary", "plan"} <= sh.keys()
    assert sh["checks"]["dbo_vs_serial"] == {"rel": 1e-6, "token_median": 2e-7}
    assert sh["measurements"][0] == {"mode": "compute", "num_sms": None, "sm_carveout": None,
                                     "timing": sh["measurements"][0]["timing"]}
    assert sh["measurements"][6]["skipped"] == "time budget" and "timing" not in sh["measurements"][6]
    s = sh["summary"]
    assert s["speedup"] == pytest.approx(3.0 / 2.4) and s["wrapper_config"] == "autotuned"
    assert s["efficiency"] == pytest.approx((3.0 - 2.4) / 2 / (1.0 / 2))
    assert not doc["args"]["out"].startswith("/") and doc["args"]["layout"] == "all2all"  # no machine path
    assert "link_model" not in doc["args"] and again.options.link_model.gbps == 50.0
    assert doc["autotune"] == {"64": {"ok": True, "decode_only": False, "threshold": 64, "schedule": "split",
                                      "never_split": False, "margin": 0.02, "rows": [{"tokens": 64}],
                                      "table": "threshold: split 64"}}
    # the table reads the record or its JSON alike
    assert format_table(again) == format_table(doc)
    with pytest.raises(ValueError, match="not an overlap bundle"):
        OverlapResult.from_json({"schema": "something else"})
