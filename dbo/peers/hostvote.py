"""The split decision's agreement through host shared memory, for a group on one host.

:func:`dbo.split.plan_ubatches` agrees on a split with a MAX over every rank's vote (a few
int64). Over gloo that is one ``all_reduce`` per decision; where a step is host-bound (eager
decode), its latency and its tail are on every step. Over NCCL it is a GPU all-reduce read back
on the host, which also holds the host until the GPU has caught up with everything queued before
it. Where every rank of the group runs on this host (gloo or NCCL), the vote goes through a
:class:`dbo.peers.hostboard.HostBoard` instead: each rank publishes its
vote for decision number ``n`` and takes the MAX of everyone's, on the host. Measured with
``tools/probes/vote_cost.py`` (2 ranks on a 2-core VM): gloo 450 us median (p90 4 ms), the board
13.5 us (p90 17 us).

The board of a group is opened at its first decision (collective: the ranks exchange their
hostnames and shared-memory names, then check that they see each other's memory; ranks on
several hosts, or sharing a hostname but not /dev/shm as containers may, keep gloo), so every
rank must take the same path: the choice depends only on the group and on ``DBO_HOST_VOTE``
(``0``: always gloo), which must be the same on every rank. A peer that
does not vote makes the others raise :class:`dbo.errors.CollectiveTimeoutError` after the
:func:`dbo.peers.watchdog.collective_timeout` in force (default: the process group's timeout), and
at once (within about a second) where its process has exited.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dbo.errors import CollectiveTimeoutError
from dbo.peers.hostboard import HostBoard, open_shared_checked

__all__ = ["HostVote", "host_vote", "reset_host_votes", "ENV"]

#: ``0`` turns the shared-memory vote off (every decision through gloo)
ENV = "DBO_HOST_VOTE"


class HostVote:
    """One group's vote board: :meth:`reduce_max` is the vote's MAX over the group."""

    def __init__(self, regions: list, rank: int, width: int, pids: list[int] | None = None):
        default = getattr(dist, "default_pg_timeout", timedelta(minutes=30)).total_seconds()
        self.board = HostBoard(regions, rank, 1, default, "split decision", fields=1 + width,
                               entry="its vote for decision {seq}", pids=pids)
        self.seq = 0

    @classmethod
    def open(cls, group: Any, width: int) -> HostVote | None:
        """The group's board (collective), or None where the ranks do not share this host's
        memory (then every rank gets None)."""
        opened = open_shared_checked(group, HostBoard.nbytes(1, 1 + width), "vote")
        return None if opened is None else cls(opened[0], dist.get_rank(group), width, opened[1])

    def reduce_max(self, vec: list[int]) -> list[int]:
        if len(vec) != self.board.fields - 1:
            raise ValueError(f"a vote of {len(vec)} values on a board of {self.board.fields - 1}")
        self.seq += 1
        try:
            rows = self.board.exchange(0, self.seq, vec)
        except CollectiveTimeoutError as exc:
            raise CollectiveTimeoutError(str(exc), phase="split decision",
                                         missing_ranks=exc.missing_ranks) from exc
        return [max(col) for col in zip(*rows, strict=True)]


#: (process group, vote width) -> its board, or None where it has none; a group made again
#: (after destroy_process_group) is another object, and opens its own board
_VOTES: dict[tuple[Any, int], HostVote | None] = {}


def host_vote(group: Any, width: int) -> HostVote | None:
    """The group's :class:`HostVote`, or None where its ranks span hosts or ``DBO_HOST_VOTE=0``
    (collective at a group's first call)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    key = (group if group is not None else dist.group.WORLD, width)
    if key not in _VOTES:
        _VOTES[key] = HostVote.open(group, width)
    return _VOTES[key]


def reset_host_votes() -> None:
    """Forget every board (collectively on every rank of a group, or never: a rank that forgets
    alone opens a new board its peers do not)."""
    _VOTES.clear()
