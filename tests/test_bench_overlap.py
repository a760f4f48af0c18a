"""The overlap benchmark (``python -m dbo.bench overlap``): a torchrun smoke run on gloo whose
JSON bundle must have the documented structure (the GPU numbers themselves come from the GPU
host), its reports (the comparison of bundles, the CUDA-graph table, a run under DBO_DISABLE),
one emulated rank of a large group, and the command-line entry. The runs through each backend's
own paths (the fake DeepEP, copy_engine, a simulated link): tests/test_bench_overlap_backends.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from bench_overlap_checks import check_structure, run_bench

from dbo.backends import BACKENDS, make_backend
from dbo.bench.__main__ import main as bench_main
from dbo.bench.compare import compare_bundles, load_bundle
from dbo.testing.launch import run_entry

pytestmark = pytest.mark.long_file


def test_command_line_entry_lists_commands_and_rejects_unknown(capsys):
    assert bench_main([]) == 2
    assert bench_main(["nope"]) == 2
    assert bench_main(["--help"]) == 0
    err = capsys.readouterr().err
    assert "overlap, switch, breakdown, experts, compare" in err


def test_backend_registry_names_every_backend_module():
    for name, spec in BACKENDS.items():
        assert importlib.util.find_spec(f"dbo.backends.{spec.module}") is not None, name
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("nope", None, hidden=8, num_experts=2, topk=1, max_tokens_per_rank=4,
                     dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def naive_run(tmp_path_factory) -> tuple[Path, dict]:
    """The folder and the bundle of one run on the naive backend, the options left at their defaults
    but for DBO's SM carve-outs (none, and 4: each DBO schedule measured with both), which three
    tests read."""
    folder = tmp_path_factory.mktemp("naive")
    return folder, run_bench(folder, "--backend", "naive", "--dbo-sm-carveout", "none", "4")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bench_naive_cpu_bundle(naive_run):
    tmp_path, bundle = naive_run
    check_structure(bundle, "naive", [])
    assert bundle["shapes"][0]["tokens"] == 64
    link = bundle["env"]["link"]
    assert link["world_size"] == 2 and link["gbps_out"] > 0 and "gloo" in link["transport"]
    s = bundle["shapes"][0]["summary"]
    hidden = bundle["args"]["hidden"]
    assert s["comm_bytes"] == 2 * 1 * 64 * hidden * 4  # naive, 2 ranks, 64 float32 tokens
    assert s["link_ms"] == pytest.approx(s["comm_bytes"] / (link["gbps_out"] * 1e9) * 1e3)
    assert s["comm_x_link"] == pytest.approx(s["comm_ms"] / s["link_ms"])
    _check_compare(tmp_path, bundle)


def test_comm_bytes_per_backend():
    from dbo.bench.overlap.link import comm_bytes

    # 2 tokens on rank 0 of 4 ranks, 8 experts (2 per rank), top-3; hidden 10, 2-byte elements
    ids = torch.tensor([[0, 2, 3], [5, 7, -1]])
    kw = dict(world_size=4, rank=0, num_experts=8, hidden=10, elem_bytes=2)
    row = 10 * 2
    # token 0: remote experts 2, 3 on rank 1 (one rank); token 1: 5 on rank 2, 7 on rank 3
    assert comm_bytes("deepep_ht", ids, **kw) == 2 * 3 * row
    assert comm_bytes("all2all", ids, **kw) == 2 * 3 * row
    assert comm_bytes("deepep_ll", ids, **kw) == 2 * 4 * row  # per expert: 2, 3, 5, 7
    assert comm_bytes("naive", ids, **kw) == 2 * 3 * 2 * row
    assert comm_bytes("copy_engine", ids, **kw) == 3 * 2 * (2 * row + 2 * 3 * 4)
    # on rank 1: token 0 reaches rank 0 (expert 0; 2 and 3 are local), token 1 ranks 2 and 3
    assert comm_bytes("deepep_ht", ids, **{**kw, "rank": 1}) == 2 * 3 * row
    assert comm_bytes("deepep_ll", ids, **{**kw, "rank": 1}) == 2 * 3 * row
    # an fp8 dispatch: 1 byte and 4/128 of a scale per element out, the combine's 2 back
    fp8 = {**kw, "hidden": 256, "dispatch_elem_bytes": 1 + 4 / 128}
    assert comm_bytes("copy_engine", ids, **fp8) == 3 * 2 * (264 + 512 + 2 * 3 * 4)
    assert comm_bytes("deepep_ll", ids, **fp8) == 4 * (264 + 512)
    with pytest.raises(ValueError, match="knows"):
        comm_bytes("nope", ids, **kw)
    with pytest.raises(ValueError, match="multiple"):
        comm_bytes("naive", ids, **{**kw, "num_experts": 6})


def _check_compare(tmp_path: Path, bundle: dict) -> None:
    # a second backend's bundle of the same shapes: faster serial, slower DBO than the real one
    other = json.loads(json.dumps(bundle))
    other["args"]["backend"] = "other"
    for sh in other["shapes"]:
        s = sh["summary"]
        s["serial_ms"], s["dbo_ms"], s["merged_ms"] = s["serial_ms"] / 2, s["dbo_ms"] * 3, None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "bench_overlap.json").write_text(json.dumps(other))
    rows = compare_bundles([bundle, other])
    real = bundle["shapes"][0]["summary"]
    row = rows[0]
    assert (row["tokens"], row["intermediate"]) == (64, bundle["shapes"][0]["intermediate"])
    assert row["serial_backend"] == "other" and row["serial_ms"] == real["serial_ms"] / 2
    best_dbo = min(t for t in (real["dbo_ms"], real["merged_ms"]) if t is not None)
    assert row["dbo_ms"] == best_dbo and row["dbo_choice"].startswith("naive/")
    assert row["speedup"] == row["serial_ms"] / best_dbo
    out = tmp_path / "cmp.json"
    assert bench_main(["compare", str(tmp_path / "bundle"), str(tmp_path / "other"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    (tmp_path / "nothing").mkdir()  # a directory without a bundle: the verdict fails
    assert bench_main(["compare", str(tmp_path / "nothing")]) == 1
    with pytest.raises(SystemExit) as missing:  # a path that is not there: bad input
        bench_main(["compare", str(tmp_path / "absent")])
    assert missing.value.code == 2
    with pytest.raises(ValueError, match="not an overlap bundle"):
        load_bundle(out)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bench_dbo_sm_carveout_variants(naive_run):
    sh = naive_run[1]["shapes"][0]
    for mode in ("dbo", "merged"):
        carve = sorted((m["sm_carveout"] is None, m["sm_carveout"]) for m in sh["measurements"]
                       if m["mode"] == mode)
        assert carve == [(False, 4), (True, None)]
        assert {f"{mode}_sNone", f"{mode}_sNone_k4"} <= sh["checks"].keys()
    assert all(m["sm_carveout"] is None for m in sh["measurements"] if m["mode"] not in ("dbo", "merged"))


def test_backend_opts_parse():
    from dbo.bench.overlap.args import parse_backend_opts

    assert parse_backend_opts(["put_order=rank", "num_sms=24", "x=1.5", "flag=True"]) == \
        {"put_order": "rank", "num_sms": 24, "x": 1.5, "flag": True}
    for bad in ("novalue", "1x=2", "=3"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_backend_opts([bad])


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_cuda_graph_rows_in_the_table(naive_run):
    # the CUDA-graph table (filled on GPUs only) renders the merged and sbo captures where there are,
    # a dash where it failed, and a failed capture's error
    from dbo.bench.overlap.report import format_table

    bundle = naive_run[1]
    shape = bundle["shapes"][0]
    graph = {"ok": True, "eager_serial_ms": 2.0, "eager_dbo_ms": 3.0, "graph_serial_ms": 1.0,
             "graph_dbo_ms": 0.9, "graph_dbo_over_serial": 0.9, "dbo_replay_equals_eager": True}
    shapes = [dict(shape, cuda_graph=dict(graph, graph_merged_ms=0.8, graph_merged_over_serial=0.8,
                                          graph_sbo_ms=0.95, graph_sbo_over_serial=0.95)),
              dict(shape, tokens=128, cuda_graph=dict(graph, merged_error="RuntimeError: x")),
              dict(shape, tokens=256, cuda_graph={"ok": False, "error": "RuntimeError: capture"})]
    lines = format_table(dict(bundle, shapes=shapes)).splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("CUDA graph"))
    rows = [ln.split() for ln in lines[head + 2:head + 5]]
    assert rows[0][8:12] == ["0.80", "0.800", "0.95", "0.950"] and rows[1][8:12] == ["-"] * 4
    assert rows[2][:3] == ["256", str(shape["intermediate"]), "FAILED:"]


def test_the_graph_bound_is_the_serial_replay_over_the_larger_part():
    from dbo.bench.overlap.capture import graph_bound

    res = {"graph_serial_ms": 1.0, "graph_dbo_ms": 0.9, "graph_merged_ms": 0.8, "graph_sbo_ms": 0.95,
           "graph_compute_ms": 0.4, "graph_comm_ms": 0.7}
    graph_bound(res)
    assert res["graph_best"] == "merged" and res["graph_best_ms"] == 0.8
    assert res["graph_best_speedup"] == pytest.approx(1.25)
    assert res["graph_bound_speedup"] == pytest.approx(1 / 0.7)
    assert res["graph_efficiency"] == pytest.approx(0.2 / 0.4)
    res = {"graph_serial_ms": 1.0, "graph_dbo_ms": 1.1}  # no parts alone: no bound
    graph_bound(res)
    assert res["graph_best_speedup"] == pytest.approx(1 / 1.1) and "graph_bound_speedup" not in res


@pytest.mark.timeout(180)
def test_bench_as_one_emulated_rank_of_a_large_group(tmp_path):
    # plain python (no torchrun): one process plays rank 3 of 16 in deepep_ll's layout under the
    # NIC-like preset link; the model keeps 32 / 16 local experts (hidden 512: on a CPU the bf16
    # layers take seconds a step at 2048; two timed steps and no warm-up per configuration)
    bundle = run_bench(tmp_path, "--emulate-ep", "16", "--emulate-rank", "3", "--link", "deepep-ib",
                       "--hidden", "512", "--experts", "32", "--tokens", "16", "--modes", "serial", "dbo",
                       "sbo_dbo", "--steps", "2", "--warmup", "0",
                       "--save-config", str(tmp_path / "ep16.json"), nproc=None)
    from dbo.deployment import load_deployment_config

    tuned = load_deployment_config(tmp_path / "ep16.json")  # what the autotune chose for EP16
    assert tuned.deployment["ep_size"] == 16 and tuned.deployment["link"]["name"] == "deepep-ib"
    assert tuned.split.adaptive is False
    assert bundle["args"]["backend"] == "emulated" and bundle["args"]["layout"] == "deepep_ll"
    assert bundle["env"]["simulated_link"]["name"] == "deepep-ib"
    assert bundle["env"]["simulated_link"]["order"] == "nic"
    assert bundle["shapes"][0]["summary"]["serial_ms"] > 0


def test_a_graph_decode_run_saves_the_replays_choice():
    # decode with --cuda-graph: the saved decode threshold and schedule are the replays' (from the
    # smallest token count that beats the replayed serial step by 2% at every larger one)
    from dbo.bench.overlap.command import graph_decode_choice
    from dbo.bench.overlap.record import ShapeRecord
    from dbo.expert_schedule import ExpertSchedule
    from dbo.split import NEVER_SPLIT

    def shape(tokens: int, serial: float, dbo: float, merged: float | None = None) -> ShapeRecord:
        graph = {"ok": True, "graph_serial_ms": serial, "graph_dbo_ms": dbo}
        if merged is not None:
            graph["graph_merged_ms"] = merged
        return ShapeRecord(backend="emulated", tokens=tokens, intermediate=2048, shared_intermediate=2048,
                           layers=8, cuda_graph=graph)

    shapes = [shape(32, 1.0, 1.3), shape(64, 1.0, 0.99), shape(128, 1.0, 0.85, merged=0.95),
              shape(256, 2.0, 1.7, merged=1.6), shape(512, 3.0, 2.5)]
    threshold, schedule, speedups = graph_decode_choice(shapes)
    assert (threshold, schedule) == (128, ExpertSchedule.SPLIT)  # 64 is within the margin
    assert speedups[256] == pytest.approx(2.0 / 1.6)  # merged was the faster there
    assert graph_decode_choice(shapes[:2])[0] == NEVER_SPLIT
    failed = ShapeRecord(backend="emulated", tokens=64, intermediate=2048, shared_intermediate=2048, layers=8,
                         cuda_graph={"ok": False})
    assert graph_decode_choice([failed]) is None


@pytest.mark.parametrize("args,wanted", [
    (["--emulate-ep", "1"], "at least 2 ranks"),
    (["--emulate-ep", "16", "--emulate-rank", "16"], "--emulate-rank 16"),
    (["--emulate-ep", "12"], "--gpus-per-host 8"),
    (["--emulate-ep", "16", "--backend", "all2all"], "leave --backend out"),
    (["--backend", "emulated"], "--emulate-ep N"),
    (["--emulate-ep", "16", "--link", "nope"], "--link nope"),
])
def test_bad_emulation_options_are_one_line(args, wanted, capsys):
    from dbo.bench.overlap.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert wanted in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bench_under_dbo_disable_says_dbo_was_off(tmp_path):
    out = tmp_path / "bundle"
    argv = ["-m", "dbo.bench", "overlap", "--device", "cpu", "--quick", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DBO_DISABLE": "1"}
    proc = run_entry(argv, nproc=2, cwd=tmp_path, env=env, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    lines = proc.stdout.strip().splitlines()
    # the table says so above its rows, and its DBO speedups and choices read "off"
    head = lines.index(next(ln for ln in lines if ln.startswith("tokens ") and "speedup" in ln))
    assert lines[head - 1].startswith("DBO_DISABLE=1: DBO was disabled"), log
    row = lines[head + 1].split()
    cols = lines[head].split()
    assert row[cols.index("speedup") - 1] == "off" and row[-1] == "off", log  # "x link": two words
    assert "DBO_DISABLE=1: no DBO schedule could be timed" in proc.stdout, log
    assert lines[-1].startswith("python -m dbo.bench overlap: PASS: DBO_DISABLE=1: DBO was disabled"), log
    assert "serial and DBO outputs" not in lines[-1], log
    bundle = json.loads((out / "bench_overlap.json").read_text())
    assert bundle["env"]["dbo_disabled"] is True
    assert all(sh["plan"].startswith("plain") for sh in bundle["shapes"]), bundle["shapes"][0]["plan"]


@pytest.mark.timeout(180)
def test_a_measured_shape_frees_its_replays_before_the_next(tmp_path, monkeypatch):
    # the compute-alone and comm-alone steps hold every layer's recorded receive (a GB and more a
    # layer at prefill sizes); the bench keeps its shapes for the autotune, so a shape must drop
    # them once measured, before the next shape records its own
    from dbo.bench.overlap import command
    from dbo.bench.overlap.shape import ShapeBench

    made: list[ShapeBench] = []
    held: list[list[int]] = []
    init, record = ShapeBench.__init__, ShapeBench.compute_alone

    def tracked_init(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    def checked_compute_alone(self):
        held.append([len(sb.alone) for sb in made if sb is not self])
        record(self)
        assert self.alone, "compute_alone set no replay"

    monkeypatch.setattr(ShapeBench, "__init__", tracked_init)
    monkeypatch.setattr(ShapeBench, "compute_alone", checked_compute_alone)
    assert command.main(["--device", "cpu", "--emulate-ep", "4", "--emulate-layout", "deepep_ht",
                         "--experts", "8", "--tokens", "8", "16", "--intermediate", "16",
                         "--modes", "compute", "comm", "serial", "dbo", "--steps", "1", "--warmup", "0",
                         "--no-autotune", "--profile-shape", "none", "--out", str(tmp_path)]) in (0, None)
    assert held == [[], [0]], held  # the second shape found the first one's replays gone
