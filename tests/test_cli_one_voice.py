"""Under torchrun rank 0 speaks for the group: bad input is one line from rank 0 (the other ranks,
which found the same, are stopped silent), a rank's own refusal names the rank, and a run's bars,
rows and verdict come once. The ranks are forked from the preloaded server (dbo.testing.launch),
which stops the others once one exits, as torchrun does. (hf-generate's rows and bars once:
tests/test_hf_example.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "examples" / "moe_overlap.py")
BENCH = ["-m", "dbo.bench"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DBO_DISABLE"):
        if var not in extra:
            env.pop(var, None)
    return env


@pytest.mark.parametrize("argv, line", [
    ([DEMO, "--experts", "7"], "moe_overlap.py: --experts 7 is not a multiple of the world size 2"),
    ([*BENCH, "hf-generate", "--json", "/proc/nope/x.json"],
     "python -m dbo.bench hf-generate: --json /proc/nope/x.json: cannot write there"),
    pytest.param([*BENCH, "overlap", "--device", "cuda"], "python -m dbo.bench overlap: --device cuda: "
                 "needs CUDA", marks=NO_CUDA),
], ids=["demo-experts", "hf-generate-json", "overlap-no-cuda"])
def test_bad_input_under_two_ranks_is_rank_0s_line(tmp_path, argv, line):
    run = run_entry(argv, nproc=2, cwd=tmp_path, env=_env(), timeout=60)
    out = run.stdout + run.stderr
    # rank 0 exits 2 with the line; rank 1, waiting to be stopped, is (or exits 2 itself)
    assert run.returncodes[0] == 2 and run.returncodes[1] in (2, -15), (run.returncodes, out)
    assert run.stdout == "" and run.stderr.splitlines() == [run.stderr.strip()], out
    assert run.stderr.startswith(line), out


def test_a_refusal_of_a_rank_alone_names_the_rank(tmp_path):
    # nobody stops it: after the grace it says why itself
    program = ("import dbo.cli\ndbo.cli.REFUSAL_GRACE_S = 0.01\n"
               "dbo.cli.refuse('prog', '--x 3: must be >= 4')\n")
    run = run_entry(["-c", program], cwd=tmp_path, env=_env(RANK="1"), timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "prog: rank 1: --x 3: must be >= 4\n")
