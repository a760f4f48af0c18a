"""The test processes forked from the preloaded server (dbo.testing.launch, and DistWorld's
workers) use CUDA and NCCL: the server imports torch, transformers and dbo without touching
CUDA, so a fork of it initializes CUDA as a fresh process does.

Run: python3 -m pytest -q tests/gpu/test_launch_gpu.py -rA
"""

from __future__ import annotations

import pytest
import torch

from dbo.testing.dist import DistWorld
from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_RANK = ("import os, torch, torch.distributed as dist\n"
         "rank = int(os.environ['LOCAL_RANK'])\n"
         "torch.cuda.set_device(rank % torch.cuda.device_count())\n"
         "dist.init_process_group('nccl', device_id=torch.device('cuda', torch.cuda.current_device()))\n"
         "x = torch.full((1 << 20,), float(rank + 1), device='cuda')\n"
         "dist.all_reduce(x)\n"
         "a = torch.randn(512, 512, device='cuda')\n"
         "ok = torch.allclose(a @ a, (a.double() @ a.double()).float(), rtol=1e-2, atol=1e-2)\n"
         "os.write(1, f'rank {rank}: {x[0].item():.0f} {ok}\\n'.encode())\n"
         "dist.destroy_process_group()\n")


def test_forked_ranks_run_cuda_and_nccl():
    ranks = min(2, torch.cuda.device_count())
    run = run_entry(["-c", _RANK], nproc=ranks, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    total = ranks * (ranks + 1) // 2
    assert sorted(run.stdout.splitlines()) == [f"rank {r}: {total} True" for r in range(ranks)], run


def _job() -> tuple[float, bool]:
    import torch.distributed as dist

    x = torch.ones(1024, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return x[0].item(), torch.cuda._is_in_bad_fork()


def test_a_nccl_world_forked_from_the_preloaded_server_runs_a_job():
    ranks = min(2, torch.cuda.device_count())
    with DistWorld(ranks, backend="nccl") as world:
        got = world.run(_job, timeout_s=120)
    assert got == [(float(ranks * (ranks + 1) // 2), False)] * ranks, got
