"""The copy-engine backend's one-host check: it copies peer to peer, so every rank must share
this host (and, on CUDA, reach every other GPU). The ranks' shared memory and the board through
which they publish each dispatch's token counts are :mod:`dbo.peers.hostboard`'s."""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_one_host"]


def check_one_host(group: Any, cuda: bool) -> None:
    """Raise ``ValueError`` on every rank unless all ranks share this host (and, on CUDA, every
    GPU can reach every other by peer-to-peer copies)."""
    world = dist.get_world_size(group)
    me = (socket.gethostname(), torch.cuda.current_device() if cuda else -1)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, me, group=group)
    hosts = sorted({h for h, _ in everyone})
    if len(hosts) > 1:
        raise ValueError(f"the copy_engine backend needs every rank on one host (peer-to-peer "
                         f"copies); this group spans {hosts}: use deepep_ht or deepep_ll, whose "
                         "internode kernels cross hosts")
    if cuda:
        for _, dev in everyone:
            if dev != me[1] and not torch.cuda.can_device_access_peer(me[1], dev):
                raise ValueError(f"GPU {me[1]} cannot reach GPU {dev} by peer-to-peer copies: the "
                                 "copy_engine backend needs them; use deepep_ht or deepep_ll")
