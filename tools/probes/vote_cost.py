"""What one split decision's agreement costs the host: gloo against host shared memory.

    torchrun --nproc-per-node 4 tools/probes/vote_cost.py [--calls 2000]

The overlapped forward agrees on its split with one gloo ``all_reduce`` (MAX over the vote's
int64s, :func:`dbo.split.plan_ubatches`) per step. Where a decode step is host-bound, that is
host time on every step, and every rank waits for the slowest to arrive. This prints, per call
(median and p90 over ``--calls``, rank 0): that all-reduce, and the same values exchanged through
host shared memory (copy_engine's token-count board, every rank of one host), so the next person
can see whether a shared-memory vote for one host would pay. CPU only; no GPU is touched.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from dbo.peers.hostboard import HostBoard, open_shared
from dbo.split import SplitConfig
from dbo.split.plan import encode_vote, local_vote


def _percentiles(us: list[float]) -> str:
    us = sorted(us)
    return f"median {statistics.median(us):8.1f} us, p90 {us[int(0.9 * (len(us) - 1))]:8.1f} us"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vec = encode_vote(local_vote(64, SplitConfig(), decode_only=True), SplitConfig())
    t = torch.tensor(vec, dtype=torch.int64)
    gloo: list[float] = []
    for i in range(args.calls + 50):
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 50:
            gloo.append((time.perf_counter() - t0) * 1e6)
    board = HostBoard(open_shared(None, HostBoard.nbytes(1), "vote"), rank, 1, 60.0, "vote probe")
    shm: list[float] = []
    values = vec[:5]
    for i in range(args.calls + 50):
        t0 = time.perf_counter()
        board.exchange(0, i + 1, values)
        if i >= 50:
            shm.append((time.perf_counter() - t0) * 1e6)
    if rank == 0:
        print(f"{world} ranks, {len(vec)} int64 per vote, {args.calls} calls each")
        print(f"  gloo all_reduce (MAX):          {_percentiles(gloo)}")
        print(f"  host shared memory (5 values):  {_percentiles(shm)}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
