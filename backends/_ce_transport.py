"""Transports of the copy-engine backend: where its bytes live and how arrival is signalled.

The backend (:mod:`dbo.backends.copy_engine`) moves tokens with plain copies into the peers'
receive buffers and needs three things from a transport, all per rank of one host:

* **buffers**: per ubatch slot, three byte regions on every rank (received tokens, received
  routing rows, combined partial sums), which this rank can address on every peer;
* **signals**: ``signal(dst, channel)`` after this rank's puts to ``dst``, ``wait(src,
  channel)`` before the data from ``src`` is read. Signals are flags that go 0 -> 1 (signal)
  and 1 -> 0 (wait), so a second signal on a channel waits until the first was consumed;
* **the board**: a host-memory table through which the ranks publish the token counts of each
  dispatch. A copy needs its size on the host when it is issued, and the counts are on the host
  already (the number of rows of each rank's input), so the ranks exchange them through POSIX
  shared memory: no collective and no device sync.

:class:`CudaTransport` puts with ``Tensor.copy_`` into ``torch.distributed._symmetric_memory``
buffers of the peers (the copy engine moves them over NVLink, using no SMs) and signals with the
symmetric memory's one-thread ``put_signal``/``wait_signal`` kernels, which trap after
``timeout_s``. :class:`CpuTransport` keeps everything in shared memory and waits on the host
with the same timeout; it is the CPU stand-in the tests run on gloo, with the same layout and
protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dbo.errors import CollectiveTimeoutError

__all__ = ["BufferLayout", "HostBoard", "Transport", "CpuTransport", "CudaTransport", "TransportCache",
           "TRANSPORTS", "open_transport"]

logger = logging.getLogger(__name__)

_ALIGN = 256
# board slots per ubatch: a rank is at most one dispatch ahead of the slowest reader (it waits
# for every peer's next entry before it can write the one after), so 2 would do; 4 is margin
_BOARD_DEPTH = 4
BOARD_FIELDS = 6  # seq, then up to five int64 values per entry


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets of one ubatch slot's regions inside a rank's buffer.

    ``x``: ``[world * max_tokens, hidden]`` received tokens (``elem_bytes`` each);
    ``meta``: ``[world * max_tokens, 2 * max_topk]`` int32 routing rows (ids, float32 weights);
    ``comb``: ``[world * max_tokens, hidden]`` partial sums sent back by the experts' ranks.
    """

    world_size: int
    max_tokens: int
    hidden: int
    elem_bytes: int
    max_topk: int
    num_slots: int

    @property
    def rows(self) -> int:
        return self.world_size * self.max_tokens

    @property
    def x_bytes(self) -> int:
        return _align(self.rows * self.hidden * self.elem_bytes)

    @property
    def meta_bytes(self) -> int:
        return _align(self.rows * 2 * self.max_topk * 4)

    @property
    def slot_bytes(self) -> int:
        return 2 * self.x_bytes + self.meta_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def offset(self, slot: int, region: str) -> int:
        base = slot * self.slot_bytes
        return base + {"x": 0, "meta": self.x_bytes, "comb": self.x_bytes + self.meta_bytes}[region]


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _open_shared(group: Any, nbytes: int, tag: str) -> list[torch.Tensor]:
    """Every rank's ``nbytes`` of host shared memory as uint8 tensors, in rank order (collective).

    The files are unlinked once every rank has mapped them, so nothing is left behind even if a
    process dies later."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, uuid.uuid4().hex, group=group)
    paths = [os.path.join(_shm_dir(), f"dbo-ce-{names[0]}-{tag}-{r}") for r in range(world)]
    mine = torch.from_file(paths[rank], shared=True, size=nbytes, dtype=torch.uint8)
    mine.zero_()
    dist.barrier(group=group)
    regions = [mine if r == rank else torch.from_file(paths[r], shared=True, size=nbytes,
                                                      dtype=torch.uint8)
               for r in range(world)]
    dist.barrier(group=group)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths[rank])
    return regions


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


class HostBoard:
    """Per ubatch slot, each rank's latest entries ``(seq, v0..v4)`` in host shared memory.

    ``exchange(slot, seq, values)`` publishes this rank's values for dispatch number ``seq``
    (counted from 1: the zeroed table means "nothing published") of that slot and returns every
    rank's, waiting (on the host, at most ``timeout_s``) for the peers to publish theirs. This
    is where the host waits for its peers: only for their hosts to reach the same dispatch,
    never for a GPU.
    """

    def __init__(self, regions: list[torch.Tensor], rank: int, num_slots: int, timeout_s: float,
                 what: str):
        self.rank = rank
        self.timeout_s = timeout_s
        self.what = what
        shape = (num_slots, _BOARD_DEPTH, BOARD_FIELDS)
        n = num_slots * _BOARD_DEPTH * BOARD_FIELDS
        self.tables = [r[: n * 8].view(torch.int64).numpy().reshape(shape) for r in regions]

    @staticmethod
    def nbytes(num_slots: int) -> int:
        return _align(num_slots * _BOARD_DEPTH * BOARD_FIELDS * 8)

    def exchange(self, slot: int, seq: int, values: list[int]) -> list[list[int]]:
        if len(values) > BOARD_FIELDS - 1:
            raise ValueError(f"at most {BOARD_FIELDS - 1} values per entry, got {len(values)}")
        entry = self.tables[self.rank][slot, seq % _BOARD_DEPTH]
        entry[1:1 + len(values)] = values
        entry[0] = seq  # last: a reader that sees the seq sees the values
        rows: list[list[int]] = []
        deadline = None
        for peer, table in enumerate(self.tables):
            e = table[slot, seq % _BOARD_DEPTH]
            spins = 0
            while int(e[0]) != seq:
                spins += 1
                if spins > 64:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise CollectiveTimeoutError(
                            f"{self.what}: rank {self.rank} waited {self.timeout_s:.1f} s for rank "
                            f"{peer} to publish the token count of dispatch {seq} of ubatch {slot} "
                            f"(it published {int(e[0])}): the peer died or fell out of step")
                    time.sleep(0 if spins < 1024 else 1e-4)
            rows.append([int(v) for v in e[1:1 + len(values)]])
        return rows


class Transport:
    """Buffers and signals of one rank; see the module docstring.

    ``seq[slot]`` counts the dispatches of each slot and ``last_wait[slot]`` holds the event
    after the slot's latest GPU wait: they belong to the buffers, not to one backend object,
    since several backends (one per MoE layer) may share a transport.
    """

    rank: int
    world_size: int
    layout: BufferLayout
    board: HostBoard
    cuda: bool

    def _init_state(self) -> None:
        self.seq = [0] * self.layout.num_slots
        self.last_wait: dict[int, tuple[Any, str]] = {}

    def region(self, peer: int, slot: int, name: str, nbytes: int, offset: int = 0) -> torch.Tensor:
        """``nbytes`` of ``peer``'s region ``name`` of ``slot`` from byte ``offset``, as uint8."""
        raise NotImplementedError

    def signal(self, dst: int, channel: int) -> None:
        raise NotImplementedError

    def wait(self, src: int, channel: int) -> None:
        raise NotImplementedError


class CpuTransport(Transport):
    """Host shared memory: puts are memory copies, signals are flags waited for on the host."""

    cuda = False

    def __init__(self, group: Any, layout: BufferLayout, num_channels: int, timeout_s: float):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.layout = layout
        self.timeout_s = timeout_s
        board = HostBoard.nbytes(layout.num_slots)
        flags = _align(num_channels * self.world_size * 4)
        regions = _open_shared(group, board + flags + layout.total_bytes, "cpu")
        self.board = HostBoard(regions, self.rank, layout.num_slots, timeout_s, "copy_engine")
        n = num_channels * self.world_size
        self._flags = [r[board:board + 4 * n].view(torch.int32).numpy()
                       .reshape(num_channels, self.world_size) for r in regions]
        self._data = [r[board + flags:] for r in regions]
        self._init_state()

    def region(self, peer, slot, name, nbytes, offset=0):
        start = self.layout.offset(slot, name) + offset
        return self._data[peer][start:start + nbytes]

    def _spin(self, flag: np.ndarray, idx: tuple[int, int], want: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while int(flag[idx]) != want:
            spins += 1
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(f"copy_engine: rank {self.rank} {what} for more than "
                                             f"{self.timeout_s:.1f} s: the peer died or fell out "
                                             "of step")
            time.sleep(0 if spins < 1024 else 1e-4)

    def signal(self, dst, channel):
        flag = self._flags[dst]
        self._spin(flag, (channel, self.rank), 0,
                   f"waited for rank {dst} to consume its previous signal on channel {channel}")
        flag[channel, self.rank] = 1

    def wait(self, src, channel):
        flag = self._flags[self.rank]
        self._spin(flag, (channel, src), 1, f"waited for rank {src}'s signal on channel {channel}")
        flag[channel, src] = 0


def _symm_mem_rendezvous(nbytes: int, device: torch.device, group: Any) -> tuple[torch.Tensor, Any]:
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch, deprecated (a no-op) by newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable((group or dist.group.WORLD).group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return buf, symm_mem.rendezvous(buf, group or dist.group.WORLD)


class CudaTransport(Transport):
    """Symmetric memory of one host: puts are copy-engine copies into the peers' buffers."""

    cuda = True

    def __init__(self, group: Any, layout: BufferLayout, num_channels: int, timeout_s: float,
                 device: torch.device):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.layout = layout
        self.timeout_ms = max(int(timeout_s * 1000), 1)
        board = HostBoard.nbytes(layout.num_slots)
        regions = _open_shared(group, board, "board")
        self.board = HostBoard(regions, self.rank, layout.num_slots, timeout_s, "copy_engine")
        self._buf, self._handle = _symm_mem_rendezvous(layout.total_bytes, device, group)
        self._peers = [self._buf if r == self.rank else
                       self._handle.get_buffer(r, (layout.total_bytes,), torch.uint8, 0)
                       for r in range(self.world_size)]
        # channels are the symmetric memory's own: its signal pad has world_size flags each
        pad = self._handle.get_signal_pad(self.rank).numel() * 4
        if num_channels * self.world_size * 4 > pad:
            raise ValueError(f"the symmetric memory signal pad ({pad} bytes) has too few channels "
                             f"for {num_channels} (num_ubatches too large)")
        self._init_state()

    def region(self, peer, slot, name, nbytes, offset=0):
        start = self.layout.offset(slot, name) + offset
        return self._peers[peer][start:start + nbytes]

    def signal(self, dst, channel):
        self._handle.put_signal(dst, channel, self.timeout_ms)

    def wait(self, src, channel):
        self._handle.wait_signal(src, channel, self.timeout_ms)


class TransportCache:
    """The live transports, one per (group, device, layout, channels, timeout): every MoE layer
    of a model builds its own backend, and they share one set of buffers (48 layers of
    Qwen3-30B-A3B would otherwise hold 48 sets). Every rank must build its backends with the
    same arguments in the same order (as it must for DeepEP's shared buffer), so that all ranks
    find or all create a transport together. Held strongly, on purpose: freeing on the last
    backend's death would depend on when each rank's garbage collector runs, and a rank that
    still held its transport would find it while another created a new one (a collective) and
    hung. :meth:`reset` frees them (on every rank, with no backend in use)."""

    def __init__(self) -> None:
        self._live: dict[tuple, Transport] = {}

    def get(self, group: Any, layout: BufferLayout, num_channels: int, timeout_s: float,
            device: torch.device) -> Transport:
        name = (group or dist.group.WORLD).group_name
        key = (name, str(device), layout, num_channels, timeout_s)
        hit = self._live.get(key)
        if hit is None:
            hit = _open(group, layout, num_channels, timeout_s, device)
            self._live[key] = hit
        return hit

    def __len__(self) -> int:
        return len(self._live)

    def reset(self) -> None:
        """Forget every transport, so that their buffers are freed once no backend holds them."""
        self._live.clear()


#: the process's shared copy-engine transports (see :class:`TransportCache`)
TRANSPORTS = TransportCache()


def _open(group: Any, layout: BufferLayout, num_channels: int, timeout_s: float,
          device: torch.device) -> Transport:
    check_one_host(group, device.type == "cuda")
    if device.type == "cuda":
        return CudaTransport(group, layout, num_channels, timeout_s, device)
    return CpuTransport(group, layout, num_channels, timeout_s)


def open_transport(group: Any, layout: BufferLayout, num_channels: int, timeout_s: float,
                   device: torch.device) -> Transport:
    """The transport for ``device``, shared with the other backends of the same group and
    layout (collective the first time: every rank of ``group`` calls it)."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the copy_engine backend runs on cuda or cpu, not {device.type}")
    return TRANSPORTS.get(group, layout, num_channels, timeout_s, device)
