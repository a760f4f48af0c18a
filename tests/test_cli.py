"""The entry points' front door: bad input ends in one line on stderr that names the bad value and
what is allowed, exit code 2, no traceback; under torchrun on every rank, before any collective,
so none hangs. Each case runs the entry point as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dbo.backends import BACKENDS, cpu_backends
from dbo.bench.__main__ import COMMANDS
from dbo.bench.compare import format_comparison
from dbo.bench.overlap.args import DEFAULT_BACKEND, parse_args
from dbo.testing.launch import EntryRun, run_entry

pytestmark = [pytest.mark.long_file, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "examples" / "moe_overlap.py")
BENCH = ["-m", "dbo.bench"]
README = str(ROOT / "README.md")
NOWHERE = "/proc/nope/x.json"  # no such folder, and none can be made there


def _env(env: dict[str, str]) -> dict[str, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if var not in env:
            full_env.pop(var, None)
    return full_env


def _run(args: list[str], tmp_path: Path, **env: str) -> EntryRun:
    """``python ARGS``, forked from a process that has imported torch (dbo.testing.launch)."""
    return run_entry(args, cwd=tmp_path, env=_env(env), timeout=90)


def _torchrun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=tmp_path,
                          env=_env({}), capture_output=True, text=True, timeout=90)


def _one_line(proc: EntryRun, *wanted: str) -> str:
    """The run exited 2 with one stderr line holding every ``wanted`` piece, and nothing else."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert proc.stdout == "" and "Traceback" not in out, out
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, out
    for piece in wanted:
        assert piece in lines[0], (piece, out)
    return lines[0]


@pytest.mark.parametrize("entry, args, wanted", [
    # the demo, one rank: fewer than two ubatches is nothing to overlap
    ([DEMO], ["--ubatches", "1"], ["moe_overlap.py: --ubatches 1: must be >= 2"]),
    # a backend the device cannot run, named with the ones it can
    (BENCH, ["overlap", "--device", "cpu", "--backend", "deepep_ht"],
     ["--backend deepep_ht needs --device cuda", *cpu_backends()]),
    ([DEMO], ["--device", "cuda", "--backend", "deepep_ll"], ["--backend deepep_ll moves bfloat16 only"]),
    (BENCH, ["overlap", "--device", "cpu", "--backend-opt", "put_order=rank", "--backend", "naive"],
     ["--backend-opt put_order: naive has no such option", "timeout_s"]),
    (BENCH, ["breakdown", "missing.json"], ["no such file: 'missing.json'", "gpu_trace_serial.json"]),
    (BENCH, ["switch", "--repeats", "0"], ["--repeats 0: must be >= 1"]),
    (BENCH, ["compare"], ["the following arguments are required: bundles"]),
    (BENCH, ["compare", "/nonexistent"], ["no such file or directory: /nonexistent", "bench_overlap.json"]),
    # a file that is not a bundle is the wrong file: named, not skipped into a failed verdict
    (BENCH, ["compare", str(ROOT / "README.md")], ["README.md is not an overlap bundle (not JSON",
                                                   "want a bench_overlap.json"]),
    (["-m", "dbo.bench.timeline"], [str(ROOT / "README.md"), "out.svg"],
     ["README.md is not a JSON profiler trace"]),
    # without CUDA, what is missing is CUDA (not a checkpoint for it)
    pytest.param(BENCH, ["hf-generate", "--device", "cuda"], ["--device cuda: needs CUDA"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")),
    # outputs are checked before any work: a place that cannot be written, a file for a folder
    *[(entry, [*args, option, path], [f"{option} {path}: {problem}"])
      for entry, args, option, path, problem in [
        ([DEMO], [], "--trace", NOWHERE, "cannot write there"),
        (BENCH, ["overlap", "--device", "cpu"], "--out", README, "exists and is not a folder"),
        (BENCH, ["overlap", "--device", "cpu"], "--out", "/proc/nope", "cannot write there"),
        (BENCH, ["overlap", "--device", "cpu", "--intermediate", "64"], "--save-config", NOWHERE,
         "cannot write there"),
        (BENCH, ["overlap", "--device", "cpu", "--intermediate", "64"], "--save-config", str(ROOT),
         "is a folder, want a file"),
        (BENCH, ["switch"], "--json", NOWHERE, "cannot write there"),
        (BENCH, ["compare", str(ROOT)], "--json", NOWHERE, "cannot write there"),
        (BENCH, ["experts"], "--json", NOWHERE, "cannot write there"),
        (BENCH, ["hf-prefill"], "--json", NOWHERE, "cannot write there"),
        (BENCH, ["hf-prefill"], "--profile", README, "exists and is not a folder"),
        (BENCH, ["hf-prefill"], "--save-checkpoint", README, "exists and is not a folder"),
        (BENCH, ["hf-generate"], "--json", NOWHERE, "cannot write there"),
        (BENCH, ["hf-load"], "--dir", README, "exists and is not a folder"),
        (BENCH, ["hf-load"], "--dir", "/proc/nope", "cannot write there"),
        (BENCH, ["hf-load", "--dir", "ckpt"], "--json", NOWHERE, "cannot write there"),
    ]],
    (["-m", "dbo.bench.timeline"], [README, "/proc/nope/x.svg"],
     ["svg /proc/nope/x.svg: cannot write there"]),
    # a shape that cannot fit is named with what it needs and what the device has, before the model
    (BENCH, ["overlap", "--device", "cpu", "--tokens", "100000000000"],
     ["--tokens 100000000000 (--hidden 128", "needs at least 204.8 TB a rank, and cpu has"]),
    ([DEMO], ["--tokens", "100000000000"], ["--tokens 100000000000 (--hidden 256)", "TB a rank"]),
    (BENCH, ["hf-prefill", "--shape", "1000000x1000000"],
     ["--shape 1000000x1000000 (hidden size", "TB a rank, and cpu has"]),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, entry, args, wanted):
    _one_line(_run(entry + args, tmp_path), *wanted)


def test_output_checks_accept_what_can_be_written_and_leave_nothing_behind(tmp_path):
    from dbo.cli import ArgumentParser, check_writable_file, check_writable_folder

    p = ArgumentParser(prog="t")
    check_writable_file(p, "--json", str(tmp_path / "x.json"))
    check_writable_folder(p, "--out", str(tmp_path))
    check_writable_folder(p, "--out", str(tmp_path / "a" / "b"))  # made by the run, not by the check
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as exc:
        check_writable_file(p, "--json", "/proc/x.json")  # the folder exists and takes no files
    assert exc.value.code == 2


def test_available_memory_is_read_on_the_cpu():
    from dbo.cli import available_memory_bytes

    assert available_memory_bytes("cpu") > 2**20


def test_experts_that_do_not_split_over_the_world_are_refused_before_the_group(tmp_path):
    # torchrun's WORLD_SIZE is read before any process group exists: one process, no peers
    line = _one_line(_run([*BENCH, "overlap", "--device", "cpu", "--experts", "7"], tmp_path,
                          WORLD_SIZE="2"), "--experts 7 is not a multiple of the world size 2")
    assert "e.g. --experts 6" in line


def test_unknown_command_is_named_with_the_commands(tmp_path):
    line = _one_line(_run([*BENCH, "foo"], tmp_path), "dbo.bench: unknown command 'foo'")
    assert line.endswith(f"(commands: {', '.join(COMMANDS)})")
    no_command = _run(BENCH, tmp_path)
    assert no_command.returncode == 2 and "usage: python -m dbo.bench" in no_command.stderr
    asked = _run([*BENCH, "--help"], tmp_path)
    assert asked.returncode == 0 and "overlap" in asked.stdout


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.multiproc
@NO_CUDA
def test_rank_0_alone_says_cuda_is_missing_under_two_ranks(tmp_path):
    # found before the CUDA set-up and the process group; the two ranks forked from a process that
    # has imported torch (dbo.testing.launch), as torchrun starts them: what torchrun itself adds is
    # checked under a real torchrun below
    line = "moe_overlap.py: --device cuda: needs CUDA, and this machine has no CUDA device; use --device cpu"
    run = run_entry([DEMO, "--device", "cuda"], nproc=2, cwd=tmp_path, env=_env({}), timeout=90)
    out = run.stdout + run.stderr
    assert out.count(line) == 1 and "rank 1:" not in out, out  # rank 0's line, rank 1 silent
    # rank 0 exits 2; rank 1 exits 2 too, or takes the SIGTERM sent once rank 0 had failed
    assert run.returncodes[0] == 2 and set(run.returncodes) <= {2, -15}, (run.returncodes, out)
    assert "Traceback" not in out, out


@pytest.mark.multiproc
def test_rank_0_says_it_under_torchrun_and_torchrun_adds_what_the_readme_says(tmp_path):
    args = ["--experts", "7"]
    line = "moe_overlap.py: --experts 7 is not a multiple of the world size 2"
    proc = _torchrun(["--standalone", "--nproc-per-node", "2", DEMO, *args], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # torchrun's own, whatever the ranks'
    assert out.count(line) == 1 and "rank 1:" not in out, out  # rank 0's line, rank 1 silent
    # torchrun's summary, a code per rank: 2, or its SIGTERM (-15) to the rank that had not ended
    codes = re.findall(r"exitcode\s+:\s*(-?\d+)", out)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, out
    # what README.md says torchrun adds
    readme = Path(README).read_text()
    for piece in ("ChildFailedError", "failed (exitcode: 2) local_rank: 0"):
        assert piece in out and piece in readme, (piece, out)
    if "-15" in codes:
        assert "closing signal SIGTERM" in out and "closing signal SIGTERM" in readme, out
    assert 'moe_overlap.py", line' not in out, out  # no traceback of the demo's own
    assert "dbo/" not in out.replace(DEMO, ""), out  # nor through dbo's code (torchrun's own is expected)


def test_overlap_defaults_to_a_backend_that_runs_on_the_device():
    assert DEFAULT_BACKEND["cpu"] in cpu_backends()
    assert parse_args(["--device", "cpu"]).backend == DEFAULT_BACKEND["cpu"]
    assert BACKENDS[DEFAULT_BACKEND["cuda"]].gpu_only


def test_breakdown_that_hid_nothing_ends_in_fail(tmp_path):
    def kernel(stream: int, ts: float, dur: float) -> dict:
        name = "deep_ep::dispatch" if stream == 9 else "gemm"  # stream 9: the communication
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}

    # serial: 1 ms with no compute running; DBO: the same idle, and 1 ms more compute
    serial = [kernel(7, 0, 1000), kernel(9, 1000, 1000), kernel(7, 2000, 1000)]
    dbo = [kernel(7, 0, 1500), kernel(9, 1500, 1000), kernel(7, 2500, 1500)]
    for name, events in (("s.json", serial), ("d.json", dbo)):
        (tmp_path / name).write_text(json.dumps({"traceEvents": events}))
    proc = _run([*BENCH, "breakdown", "s.json", "d.json"], tmp_path)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "\n  serial ms, DBO ms: per step, from each trace; " in proc.stdout  # the columns
    assert last.startswith("python -m dbo.bench breakdown: FAIL: the DBO step hid nothing")


def test_help_lists_every_command_with_a_line():
    asked = _run([*BENCH, "--help"], Path.cwd())
    assert asked.returncode == 0, asked.stderr
    for name, command in COMMANDS.items():
        line = next((ln for ln in asked.stdout.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None and line.split(None, 1)[1] == command.summary, asked.stdout


HELPS = [[*BENCH, name, "-h"] for name in COMMANDS] + [
    ["-m", "dbo.bench.timeline", "-h"], [DEMO, "-h"],
    [str(ROOT / "examples" / "hf_expert_parallel.py"), "-h"]]


def test_every_help_is_plain_text(tmp_path):
    # docstrings and option help without reStructuredText, and no default that says nothing
    # (None, an empty list, or the value a flag such as --no-autotune turns off)
    for argv in HELPS:
        run = _run(argv, tmp_path)
        assert run.returncode == 0 and run.stdout.startswith("usage:"), (argv, run.stdout + run.stderr)
        for bad in (":class:", ":mod:", ":func:", "``", "(default: None)", "(default: True)",
                    "(default: False)", "(default: [])"):
            assert bad not in run.stdout, (argv, bad, run.stdout)
        assert not re.search(r"::$", run.stdout, re.M), (argv, run.stdout)


def test_compare_names_its_ratio_for_what_it_is():
    # best serial 12.28 ms, best DBO 9.95 ms: a speedup of 1.234x, headed as serial over DBO
    row = {"tokens": 4096, "intermediate": 256, "serial_ms": 12.28, "serial_backend": "deepep_ht",
           "dbo_ms": 9.95, "dbo_choice": "copy_engine/split", "speedup": 12.28 / 9.95, "comm_ms": {}}
    head, _, cells = ([c.strip() for c in line.strip("|").split("|")]
                      for line in format_comparison([row]).splitlines()[:3])
    assert cells[head.index("speedup (best serial / best DBO)")] == "1.234x"


def test_compare_leaves_out_the_dbo_rows_of_a_bundle_made_under_dbo_disable(tmp_path):
    def bundle(backend: str, disabled: bool, dbo_ms: float) -> dict:
        return {"schema": "dbo.bench_overlap/1", "args": {"backend": backend},
                "env": {"dbo_disabled": disabled}, "shapes": [{"tokens": 64, "intermediate": 64, "summary": {
                    "serial_ms": 10.0, "dbo_ms": dbo_ms, "merged_ms": None, "comm_ms": 2.0}}]}

    for name, disabled, dbo_ms in (("on", False, 8.0), ("off", True, 5.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench_overlap.json").write_text(json.dumps(bundle(name, disabled, dbo_ms)))
    run = _run([*BENCH, "compare", "on", "off"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("DBO_DISABLE=1 when off ran: DBO was disabled there"), run.stdout
    row = next(ln for ln in lines if ln.startswith("| 64 | 64 |"))
    assert "8.00 (on/split)" in row and "1.250x" in row, row  # the disabled bundle's 5.0 is not DBO's
    under = lines[lines.index(row) + 1]  # the columns
    assert under.startswith("  T: tokens per rank; ") and "speedup: best serial / best DBO" in under, under
    assert lines[-1].startswith("python -m dbo.bench compare: PASS: DBO_DISABLE=1 when off ran"), run.stdout


def test_the_plot_hint_names_an_extra_that_holds_matplotlib():
    tomllib = pytest.importorskip("tomllib")
    from dbo.bench.overlap.report import PLOT_HINT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extra = re.search(r"\.\[(\w+)\]", PLOT_HINT).group(1)
    assert any(dep.startswith("matplotlib") for dep in extras[extra]), (extra, extras)
