"""Host shared memory between the ranks of one host: regions, and a board to exchange small
values without a collective.

* :func:`open_shared`: every rank's region of POSIX shared memory (collective), unlinked once
  mapped, so nothing is left behind;
* :func:`open_shared_checked`: the same where it is optional: None on every rank where the
  ranks are not on one host or do not share its memory;
* :class:`HostBoard`: a table through which the ranks publish a few int64 per numbered round
  and read everyone's, waiting on the host (never on a GPU) for the peers to publish theirs.
  The copy-engine backend exchanges its token counts through one; the split decision's vote
  goes through one where the group is on one host (:mod:`dbo.peers.hostvote`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from dbo.errors import CollectiveTimeoutError
from dbo.peers.arrival import process_state
from dbo.peers.groups import collective_device
from dbo.peers.watchdog import resolve_timeout

__all__ = ["ALIGN", "align", "open_shared", "open_shared_with_pids", "open_shared_checked", "HostBoard",
           "BOARD_FIELDS"]

ALIGN = 256
# board slots per ubatch: a rank is at most one dispatch ahead of the slowest reader (it waits
# for every peer's next entry before it can write the one after), so 2 would do; 4 is margin
_BOARD_DEPTH = 4
BOARD_FIELDS = 6  # seq, then up to five int64 values per entry


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _paths(name: str, tag: str, world: int) -> list[str]:
    return [os.path.join(_shm_dir(), f"dbo-{name}-{tag}-{r}") for r in range(world)]


def _region(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def open_shared(group: Any, nbytes: int, tag: str) -> list[torch.Tensor]:
    """Every rank's ``nbytes`` of host shared memory as uint8 tensors, in rank order (collective).

    The files are unlinked once every rank has mapped them, so nothing is left behind even if a
    process dies later."""
    return open_shared_with_pids(group, nbytes, tag)[0]


def open_shared_with_pids(group: Any, nbytes: int, tag: str) -> tuple[list[torch.Tensor], list[int]]:
    """:func:`open_shared`, and the ranks' process ids (exchanged in the same collective), for a
    :class:`HostBoard` whose wait for a peer that exited ends at once."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, (uuid.uuid4().hex, os.getpid()), group=group)
    paths = _paths(names[0][0], tag, world)
    mine = _region(paths[rank], nbytes)
    mine.zero_()
    dist.barrier(group=group)
    regions = [mine if r == rank else _region(paths[r], nbytes) for r in range(world)]
    dist.barrier(group=group)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths[rank])
    return regions, [int(pid) for _, pid in names]


def open_shared_checked(group: Any, nbytes: int, tag: str
                        ) -> tuple[list[torch.Tensor], list[int]] | None:
    """:func:`open_shared` for an optional path over a group (gloo or NCCL): None on every rank where the
    ranks are not all on this host, or where one does not see what each peer wrote into its own
    region (a container with a /dev/shm of its own may share the hostname and not the memory);
    nothing is raised, nothing is left behind. Returns the regions and the ranks' pids."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nonce = -1 - int.from_bytes(os.urandom(7), "little")  # negative: never a board's seq
    info: list[Any] = [None] * world
    dist.all_gather_object(info, (uuid.uuid4().hex, nonce, os.getpid(), socket.gethostname()),
                           group=group)
    if len({host for *_, host in info}) > 1:  # the same answer on every rank
        return None
    paths = _paths(info[0][0], tag, world)
    size = max(nbytes, 8)
    regions: list[torch.Tensor] | None = None
    mine = None
    try:
        mine = _region(paths[rank], size)
        mine.zero_()
        mine[:8].view(torch.int64)[0] = nonce
    except (OSError, RuntimeError):
        mine = None
    dist.barrier(group=group)
    if mine is not None:
        try:
            regions = [mine if r == rank else _region(paths[r], size) for r in range(world)]
            if any(int(regions[r][:8].view(torch.int64)[0]) != info[r][1] for r in range(world)):
                regions = None
        except (OSError, RuntimeError):
            regions = None
    failed = torch.tensor([0 if regions is not None else 1], dtype=torch.int64,
                          device=collective_device(group))
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)  # every rank checked its peers
    # after the all-reduce every rank has mapped what it could: its own file goes; where the
    # check failed, so do the peers' names this rank may have created in a private /dev/shm
    for r in (range(world) if int(failed.item()) else (rank,)):
        with contextlib.suppress(OSError):
            os.unlink(paths[r])
    if int(failed.item()) or regions is None:
        return None
    regions[rank][:8].zero_()
    return [r[:nbytes] for r in regions], [info[r][2] for r in range(world)]


class HostBoard:
    """Per slot, each rank's latest entries ``(seq, v0, ...)`` in host shared memory (``fields``
    int64 an entry, the seq first).

    ``exchange(slot, seq, values)`` publishes this rank's values for dispatch number ``seq``
    (counted from 1: the zeroed table means "nothing published") of that slot and returns every
    rank's, waiting (on the host, at most ``timeout_s``) for the peers to publish theirs. This
    is where the host waits for its peers: only for their hosts to reach the same dispatch,
    never for a GPU.
    """

    def __init__(self, regions: list[torch.Tensor], rank: int, num_slots: int, timeout_s: float,
                 what: str, *, fields: int = BOARD_FIELDS,
                 entry: str = "the token count of dispatch {seq} of ubatch {slot}",
                 pids: list[int] | None = None):
        self.pids = pids  # the ranks' processes: a wait for one that exited ends at once
        self.rank = rank
        self.timeout_s = timeout_s
        self.what = what
        self.fields = fields
        self.entry = entry
        shape = (num_slots, _BOARD_DEPTH, fields)
        n = num_slots * _BOARD_DEPTH * fields
        self.tables = [r[: n * 8].view(torch.int64).numpy().reshape(shape) for r in regions]

    @staticmethod
    def nbytes(num_slots: int, fields: int = BOARD_FIELDS) -> int:
        return align(num_slots * _BOARD_DEPTH * fields * 8)

    def exchange(self, slot: int, seq: int, values: list[int]) -> list[list[int]]:
        if len(values) > self.fields - 1:
            raise ValueError(f"at most {self.fields - 1} values per entry, got {len(values)}")
        entry = self.tables[self.rank][slot, seq % _BOARD_DEPTH]
        entry[1:1 + len(values)] = values
        entry[0] = seq  # last: a reader that sees the seq sees the values
        rows: list[list[int]] = []
        deadline = None
        timeout_s = resolve_timeout(self.timeout_s)  # a collective_timeout() block overrides it
        for peer, table in enumerate(self.tables):
            e = table[slot, seq % _BOARD_DEPTH]
            spins = 0
            while int(e[0]) != seq:
                spins += 1
                if spins > 64:
                    now = time.monotonic()
                    deadline = deadline or now + timeout_s
                    if self.pids is not None and spins % 4096 == 0 \
                            and process_state(self.pids[peer]) == "exited":
                        raise CollectiveTimeoutError(
                            f"{self.what}: rank {self.rank} waited for rank {peer} to publish "
                            f"{self.entry.format(seq=seq, slot=slot)}, but its process "
                            f"(pid {self.pids[peer]}) exited", missing_ranks=(peer,))
                    if now > deadline:
                        raise CollectiveTimeoutError(
                            f"{self.what}: rank {self.rank} waited {timeout_s:.1f} s for rank "
                            f"{peer} to publish {self.entry.format(seq=seq, slot=slot)} "
                            f"(it published {int(e[0])}): the peer died or fell out of step")
                    time.sleep(0 if spins < 1024 else 1e-4)
            rows.append([int(v) for v in e[1:1 + len(values)]])
        return rows
