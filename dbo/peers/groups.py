"""A process group's size, this rank in it, and where a small tensor for a collective over it
lives: what the peers' modules need of a group before any of them talks to it (re-exported by
:mod:`dbo.peers.collectives`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["group_size", "group_rank", "collective_device"]


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (the default group if None); 1 where no process group is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group if None); 0 where no process group
    is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def collective_device(group: Any = None) -> torch.device:
    """Where a small tensor for a collective over ``group`` lives: this rank's GPU on an NCCL
    group (NCCL takes CUDA tensors only), else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
