"""The small collectives ranks use to agree: the group's size, where a small tensor for it lives,
and an element-wise MAX of a few numbers that never waits longer than the collective timeout.

Every MAX over a group in dbo goes through :func:`all_reduce_max`: the split vote, the
autotune's agreement on its timings, the benchmarks' per-step times and checks. On a CPU group
whose ranks share this host, integer values go through host shared memory
(:mod:`dbo.peers.hostvote`, microseconds instead of gloo's hundreds); elsewhere through
``all_reduce``. On a CPU group with a collective timeout in force
(:func:`dbo.peers.watchdog.collective_timeout`), a peer that never arrives raises
:class:`dbo.errors.CollectiveTimeoutError` after that timeout; on CUDA the GPU watchdog bounds
the wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dbo.errors import CollectiveTimeoutError
from dbo.peers.groups import collective_device, group_rank, group_size
from dbo.peers.hostvote import host_vote
from dbo.peers.watchdog import current_timeout
from dbo.peers.work import LentWork

__all__ = ["group_size", "group_rank", "collective_device", "all_reduce_max"]


def all_reduce_max(values: Sequence[int] | Sequence[float], group: Any = None, *,
                   device: torch.device | str | None = None,
                   phase: str = "split decision") -> list:
    """Element-wise MAX of ``values`` over ``group``, as a list of the same length and type
    (int64 if every value is an int, else float64). Without a process group, or in a group of
    one, it is ``list(values)``. Collective: every rank calls it with the same length.

    ``device``: where the tensor lives (default :func:`collective_device`). ``phase`` names the
    wait in a :class:`~dbo.errors.CollectiveTimeoutError`.
    """
    import torch.distributed as dist

    values = list(values)
    if group_size(group) == 1:
        return values
    ints = all(isinstance(v, int) for v in values)
    if ints and (device is None or torch.device(device).type == "cpu"):
        # every rank on this host: through shared memory, on an NCCL group too (where the
        # all-reduce's CUDA tensor, read back, would hold the host until the GPU caught up)
        board = host_vote(group, len(values))
        if board is not None:
            return board.reduce_max(values)
    if device is None:
        device = collective_device(group)
    t = torch.tensor(values, dtype=torch.int64 if ints else torch.float64, device=device)
    if t.is_cuda:  # the GPU watchdog bounds the wait
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()
    timeout_s = current_timeout()
    # a LentWork: the wait returns once gloo's thread has freed the work, so a program may end
    # right after this vote (dbo.peers.work says why that matters)
    work = LentWork(lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group, async_op=True),
                    [t])
    try:
        done = work.wait(timeout_s)
    except RuntimeError as exc:  # gloo raises on its timeout
        if timeout_s is None:
            raise
        raise CollectiveTimeoutError(
            f"{phase}: rank {dist.get_rank(group)} waited {timeout_s:.1f} s for its peers' "
            f"votes ({exc}); a peer died or fell out of step", phase=phase) from exc
    if done is False:
        raise CollectiveTimeoutError(
            f"{phase}: rank {dist.get_rank(group)} waited {timeout_s:.1f} s for its peers' "
            "votes; a peer died or fell out of step", phase=phase)
    return t.tolist()
