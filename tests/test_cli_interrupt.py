"""Ctrl-C ends an entry point with one line (from rank 0 under torchrun, the other ranks silent),
exit code 130, nothing left running and no file half-written. Each entry point runs forked from
the preloaded server (dbo.testing.launch), which sends SIGINT to every process in the middle of
the run, as a terminal does to its foreground processes (and, for ranks, a second one, as
torchrun's agent forwards it)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dbo.cli import INTERRUPTED_EXIT_CODE
from dbo.files import write_whole
from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "examples" / "moe_overlap.py")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DBO_DISABLE"):
        env.pop(var, None)
    (tmp_path / "tmp").mkdir()
    return env


def _interrupted(argv: list[str], tmp_path: Path, line: str, *, nproc: int | None = None,
                 interrupt: str | float) -> None:
    """``argv`` interrupted: every process exited 130, the output is ``line`` alone on stderr
    (and what the run printed before the Ctrl-C), no temporary file or folder is left."""
    run = run_entry(argv, nproc=nproc, cwd=tmp_path, env=_env(tmp_path), timeout=120,
                    interrupt=interrupt)
    out = run.stdout + run.stderr
    assert run.returncodes == [INTERRUPTED_EXIT_CODE] * (nproc or 1), out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert run.stderr.count(line) == 1 and run.stderr.rstrip().endswith(line), out
    assert list((tmp_path / "tmp").iterdir()) == [], out  # temporary checkpoints and files removed
    left = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert left == [], left
    for written in tmp_path.rglob("*.json"):  # whole or absent
        json.loads(written.read_text())


@pytest.mark.multiproc
def test_demo_under_two_ranks(tmp_path):
    _interrupted([DEMO, "--steps", "100000"], tmp_path, "moe_overlap.py: interrupted (Ctrl-C)",
                 nproc=2, interrupt=6.0)
    assert not (tmp_path / "moe_overlap.trace.json").exists()


@pytest.mark.multiproc
def test_bench_overlap_under_two_ranks_in_its_progress(tmp_path):
    # interrupted once its progress shows: the bundle so far, if any, is whole
    _interrupted(["-m", "dbo.bench", "overlap", "--device", "cpu", "--quick", "--out", "out"], tmp_path,
                 "python -m dbo.bench overlap: interrupted (Ctrl-C)", nproc=2, interrupt="1/")


@pytest.mark.multiproc
def test_bench_hf_generate_under_two_ranks_removes_its_checkpoint(tmp_path):
    # its temporary checkpoint lives in TMPDIR until the run ends, interrupted or not
    _interrupted(["-m", "dbo.bench", "hf-generate", "--steps", "1000"], tmp_path,
                 "hf-generate: interrupted (Ctrl-C)", nproc=2, interrupt="from_pretrained")


def test_bench_switch_plain_python(tmp_path):
    _interrupted(["-m", "dbo.bench", "switch", "--repeats", "1000000"], tmp_path,
                 "python -m dbo.bench switch: interrupted (Ctrl-C)", interrupt=3.0)


PROGRAM = """
import os, signal, sys
from dbo.cli import run_main

def main():
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        raise AssertionError("not interrupted")
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # forwarded by torchrun's agent: ignored
        print("cleaned up", flush=True)
        raise RuntimeError("a collective a peer left")  # part of the interruption

sys.exit(run_main("prog", main))
"""


@pytest.mark.parametrize("rank, line", [(None, "prog: interrupted (Ctrl-C)\n"), ("1", "")])
def test_run_main_cleans_up_once_and_speaks_on_rank_0(tmp_path, rank, line):
    env = _env(tmp_path)
    if rank is not None:
        env["RANK"] = rank
    run = run_entry(["-c", PROGRAM], cwd=tmp_path, env=env, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (INTERRUPTED_EXIT_CODE, "cleaned up\n", line)


def test_write_whole_leaves_the_old_file_when_stopped(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    write_whole(path, "old")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_whole(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    monkeypatch.undo()
    write_whole(path, b"new")
    assert path.read_text() == "new" and oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sigint_handler_is_put_back_after_a_normal_run():
    from dbo.cli import run_main

    before = signal.getsignal(signal.SIGINT)
    assert run_main("prog", lambda: 3) == 3
    assert signal.getsignal(signal.SIGINT) is before
