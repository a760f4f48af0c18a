"""Which peers reached a collective: each rank's launch count in host shared memory.

Before a backend launches anything that waits for its peers (a DeepEP dispatch or combine),
its rank bumps its count on an :class:`ArrivalBoard` and checks that every peer on the same
host has reached the same count. When they have (the usual case) that costs one shared-memory
write and one read per peer. When a peer is late the rank waits on the host, releasing the
GIL, at most the timeout, and then knows exactly which ranks did not arrive, and whether
their processes still exist. Every rank of a group launches its collectives in the same
order (the ubatch schedule is the same everywhere), so equal counts mean the same collective.

The board is one small file per rank in ``/dev/shm`` (mapped by the peers of the same host,
then unlinked, so nothing is left behind even after a crash). Ranks on other hosts are not
on it: :attr:`ArrivalBoard.remote_ranks` lists them, and the GPU watchdog
(:mod:`dbo.peers.watchdog`) is what bounds a wait for them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
import time
import uuid
from typing import Any

__all__ = ["ArrivalBoard", "process_state"]

_SLOT_BYTES = 64  # seq, pid, launch given up at; one cache line per rank
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def process_state(pid: int) -> str:
    """``"running"``, ``"exited"`` (gone, or a zombie) or ``"unknown"`` for a local ``pid``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return "exited" if state in (b"Z", b"X") else "running"
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except OSError:
        return "unknown"
    return "running"


class ArrivalBoard:
    """Per rank, the number of collective launches it has reached; readable by the peers of
    the same host.

    Build it with :meth:`create` (collective over the group). ``rank`` is the rank in the
    group; :meth:`arrive` returns this rank's new count; :meth:`missing` lists the same-host
    peers whose count is lower; :meth:`wait` waits for them.
    """

    def __init__(self, rank: int, world_size: int, views: dict[int, memoryview],
                 pids: dict[int, int], remote_ranks: list[int], maps: list[mmap.mmap]):
        self.rank = rank
        self.world_size = world_size
        self._views = views
        self._mine = views[rank]
        self._peers = [(r, v) for r, v in sorted(views.items()) if r != rank]
        self.pids = pids
        self.remote_ranks = remote_ranks
        self._maps = maps
        self.seq = 0

    @classmethod
    def local(cls, rank: int = 0, world_size: int = 1) -> ArrivalBoard:
        """A board of this process alone (one rank; tests)."""
        mm = mmap.mmap(-1, _SLOT_BYTES)
        view = memoryview(mm).cast("q")
        view[1] = os.getpid()
        return cls(rank, world_size, {rank: view}, {rank: os.getpid()},
                   [r for r in range(world_size) if r != rank], [mm])

    @classmethod
    def create(cls, group: Any = None) -> ArrivalBoard:
        """Collective over ``group`` (every rank calls it): map the same-host peers' slots."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        path = os.path.join(_SHM_DIR, f"dbo_arrival_{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _SLOT_BYTES)
            own = mmap.mmap(fd, _SLOT_BYTES)
        finally:
            os.close(fd)
        own_view = memoryview(own).cast("q")
        own_view[1] = os.getpid()
        me = (socket.gethostname(), path, os.getpid())
        everyone: list[Any] = [None] * world
        try:
            dist.all_gather_object(everyone, me, group=group)
            views, pids, maps, remote = {rank: own_view}, {rank: os.getpid()}, [own], []
            for r, (host, peer_path, pid) in enumerate(everyone):
                if r == rank:
                    continue
                if host != me[0]:
                    remote.append(r)
                    continue
                pfd = os.open(peer_path, os.O_RDWR)
                try:
                    mm = mmap.mmap(pfd, _SLOT_BYTES)
                finally:
                    os.close(pfd)
                maps.append(mm)
                views[r] = memoryview(mm).cast("q")
                pids[r] = pid
            dist.all_gather_object([None] * world, None, group=group)  # all mapped: unlink
        finally:
            os.unlink(path)
        return cls(rank, world, views, pids, remote, maps)

    def arrive(self) -> int:
        """Count one more launch of this rank; returns the new count."""
        self.seq += 1
        self._mine[0] = self.seq
        return self.seq

    def abandon(self) -> None:
        """This rank gave up at its current launch (a timeout): the peers must not wait for it
        any longer, nor take its count for an arrival at a later launch."""
        self._mine[2] = self.seq
        self._mine[0] = -1

    def missing(self, seq: int) -> list[int]:
        """Same-host peers that have not reached count ``seq``."""
        return [r for r, v in self._peers if v[0] < seq]

    def wait(self, seq: int, timeout_s: float) -> list[int]:
        """Wait (GIL released) until every same-host peer reached ``seq`` or ``timeout_s``
        passed; returns the peers still missing (empty: all arrived)."""
        if not any(v[0] < seq for _, v in self._peers):
            return []
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            missing = self.missing(seq)
            if not missing or time.monotonic() > deadline:
                return missing
            spins += 1
            time.sleep(0 if spins < 256 else 5e-5 if spins < 20000 else 1e-3)

    def describe(self, seq: int, missing: list[int]) -> str:
        """Why each of ``missing`` is behind: its count and whether its process exists."""
        parts = []
        for r in missing:
            state = process_state(self.pids[r]) if r in self.pids else "unknown"
            view = self._views.get(r)
            what = "process exited" if state == "exited" else f"process {state}"
            if view is not None and view[2]:
                parts.append(f"rank {r}: gave up at its launch {view[2]} (its own timeout), {what}")
            else:
                reached = int(view[0]) if view is not None else -1
                parts.append(f"rank {r}: {what}, at launch {reached} (this rank waits at {seq})")
        if self.remote_ranks:
            parts.append("ranks on other hosts (not visible from here): "
                         + ", ".join(str(r) for r in self.remote_ranks))
        return "; ".join(parts)

    def behind(self, seq: int) -> tuple[list[int], str]:
        """For the GPU watchdog's message: the same-host ranks behind ``seq`` or whose process
        exited (else every remote rank), and :meth:`describe`'s detail."""
        dead = [r for r, pid in self.pids.items() if r != self.rank and process_state(pid) == "exited"]
        missing = sorted(set(self.missing(seq)) | set(dead))
        if missing:
            return missing, self.describe(seq, missing)
        if self.remote_ranks:
            return list(self.remote_ranks), self.describe(seq, [])
        # every host arrived: one of the peers' GPUs did not; name them all as the suspects
        return [r for r, _ in self._peers], (
            f"every peer reached launch {seq} on the host and is running: the GPU of one of them "
            "did not take part (a kernel before it hangs there)")

    def close(self) -> None:
        views = list(self._views.values())
        self._peers = []
        self._views = {}
        self._mine = None
        for v in views:
            v.release()
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # a view still exported: the map goes with it
                mm.close()
        self._maps = []
