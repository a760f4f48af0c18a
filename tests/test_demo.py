"""The README's main command: ``torchrun --nproc-per-node 2 examples/moe_overlap.py``, run as a
subprocess (small sizes, one step) for each torch.distributed backend, and with three ubatches on
copy_engine (built for three). It must report that the DBO output equals the serial one in its
last line (a PASS verdict naming the trace), say that on CPU its times show no overlap, exit 0,
and write a loadable Chrome trace. With ``DBO_DISABLE=1`` its last line must say that both runs
were plain, and it writes no trace. The examples import only the library's public names."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO = EXAMPLES / "moe_overlap.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.parametrize("backend, extra, torchrun", [
    ("naive", [], True),  # the README's command itself
    ("all2all", ["--uneven"], False),
    ("copy_engine", ["--ubatches", "3"], False),  # its buffers hold a slot per ubatch
])
def test_demo_torchrun_two_ranks(tmp_path, backend, extra, torchrun):
    trace = tmp_path / "demo.trace.json"
    argv = [str(DEMO), "--backend", backend, "--steps", "1", "--warmup", "0", "--tokens", "64",
            "--hidden", "64", "--intermediate", "64", "--layers", "2", "--trace", str(trace), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    if torchrun:
        proc = subprocess.run([*TORCHRUN, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=150)
    else:  # torchrun's two ranks, forked from a process that has imported torch (dbo.testing.launch)
        proc = run_entry(argv, nproc=2, cwd=tmp_path, env=env, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"backend={backend} world=2" in out, out
    assert "plan (rank 0): split(" in out, out
    assert "serial:" in out and "dbo:" in out, out
    assert "on CPU the all-to-all takes the same cores as the compute, so nothing overlaps" in out, out
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("moe_overlap.py: PASS: DBO output matches serial output"), out
    assert last.endswith(f"trace of one overlapped step in {trace}"), out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ub0 running", "ub1 running", "dispatch", "combine"} <= names


def test_demo_with_dbo_disabled_says_both_runs_were_plain(tmp_path):
    # DBO_DISABLE=1: the "overlapped" run is plain too; the verdict must not claim an overlap
    # that did not happen, nor write a trace of one
    trace = tmp_path / "demo.trace.json"
    argv = [str(DEMO), "--steps", "1", "--warmup", "0", "--tokens", "64", "--hidden", "64",
            "--intermediate", "64", "--layers", "2", "--trace", str(trace)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DBO_DISABLE": "1"}
    proc = run_entry(argv, nproc=2, cwd=tmp_path, env=env, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "plan (rank 0): plain(64 tokens; disabled: DBO_DISABLE is set)" in out, out
    assert "dbo (ran plain):" in out, out
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("moe_overlap.py: PASS: no step was overlapped (disabled: DBO_DISABLE is "
                           "set): both runs were plain and agree (rel err end to end 0.0e+00"), out
    assert last.endswith("; no overlapped trace written"), out
    assert "matches" not in last and not trace.exists(), out


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_import_only_public_library_names(example):
    # an example is what a user copies: a name it needs is the library's, not the benchmarks'
    bad = []
    for node in ast.walk(ast.parse(example.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules, names = [node.module], [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [a.name for a in node.names], []
        else:
            continue
        dotted = [m for m in modules if m.startswith("dbo")]
        bad += [m for m in dotted
                if m.startswith("dbo.bench") or any(part.startswith("_") for part in m.split("."))]
        bad += [f"{node.module}.{n}" for n in names if dotted and n.startswith("_")]
    assert not bad, f"{example.name} imports what is not the library's public API: {bad}"
