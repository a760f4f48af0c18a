"""dbo.testing.launch: an entry point forked from the preloaded server behaves as the same entry
point in a process of its own (``python ARGV``, torchrun's ranks): output, exit status, argv,
environment, the working directory, a failing rank stopping the others, and a run past its
timeout killed with whatever it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dbo.testing.launch import ForkedProcess, run_entry

pytestmark = pytest.mark.timeout(120)

_SHOW = ("import os, sys\n"
         "print(sys.argv[1:], os.getcwd(), os.environ.get('DBO_X'), sys.path[0] in ('', os.getcwd()))\n"
         "print('to stderr', file=sys.stderr)\n"
         "sys.exit(int(sys.argv[1]))\n")


def test_a_forked_run_prints_and_exits_as_its_own_process_does(tmp_path):
    env = {**os.environ, "DBO_X": "42"}
    real = subprocess.run([sys.executable, "-c", _SHOW, "3", "b"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    forked = run_entry(["-c", _SHOW, "3", "b"], cwd=tmp_path, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.returncode == 3 and forked.returncodes == [3]
    assert forked.stdout == f"['3', 'b'] {tmp_path} 42 True\n"


def test_a_script_and_a_module_run_as_main(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(__name__, sys.argv, sys.path[0])\n")
    run = run_entry([str(script), "x"], cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == f"__main__ {[str(script), 'x']} {tmp_path}\n", run
    (tmp_path / "mod_here.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:], sys.argv[0].endswith('mod_here.py'))\n")
    run = run_entry(["-m", "mod_here", "y"], cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == "__main__ ['y'] True\n", run


def test_an_uncaught_error_is_reported_as_the_interpreter_reports_it():
    run = run_entry(["-c", "def f():\n    raise ValueError('bad value')\nf()\n"])
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "ValueError: bad value"
    assert 'File "<string>", line 3, in <module>' in run.stderr
    assert "launch.py" not in run.stderr and "runpy" not in run.stderr, run.stderr  # the entry's frames only
    run = run_entry(["-c", "raise SystemExit('a message')"])
    assert (run.returncode, run.stderr) == (1, "a message\n")


_RANK = ("import os, torch, torch.distributed as dist\n"
         "dist.init_process_group('gloo')\n"
         "t = torch.tensor([float(dist.get_rank() + 1)])\n"
         "dist.all_reduce(t)\n"
         "env = os.environ\n"
         "os.write(1, f\"rank {env['RANK']}/{env['WORLD_SIZE']} local {env['LOCAL_RANK']}: "
         "{t.item():.0f}\\n\".encode())\n"
         "dist.destroy_process_group()\n")


def test_ranks_join_one_group_with_torchruns_environment():
    run = run_entry(["-c", _RANK], nproc=3, timeout=60)
    assert run.returncode == 0 and run.returncodes == [0, 0, 0], run
    assert sorted(run.stdout.splitlines()) == [f"rank {r}/3 local {r}: 6" for r in range(3)], run


def test_a_failing_rank_stops_the_others_as_torchruns_agent_does():
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n    time.sleep(0.2)\n    sys.exit(5)\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    run = run_entry(["-c", code], nproc=2, timeout=60)
    assert run.returncode == 5 and run.returncodes == [-15, 5], run  # rank 0 got SIGTERM
    assert time.monotonic() - t0 < 30


def test_a_run_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired) as exc:
        run_entry(["-c", code], timeout=5)
    assert exc.value.output == "started\n"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the grandchild outlived the killed run"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_process_waits_and_is_killed_like_a_popen(tmp_path):
    log = tmp_path / "log"
    log.touch()
    p = ForkedProcess(["-c", "import time; time.sleep(60)"], stdout_path=str(log), stderr_path=str(log))
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.1)
    p.kill()
    assert p.wait(timeout=10) == -9 and p.returncode == -9


@pytest.mark.parametrize("argv, nproc, message", [
    ([], None, "argv is empty"),
    (["-m"], None, "-m needs its argument"),
    (["-c", "pass"], 0, "nproc must be >= 1"),
])
def test_bad_arguments_are_refused(argv, nproc, message):
    with pytest.raises(ValueError, match=message):
        run_entry(argv, nproc=nproc)
