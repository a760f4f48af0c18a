"""Transports of the copy-engine backend: where its bytes live and how arrival is signalled.

The backend (:mod:`dbo.backends.copy_engine`) moves tokens with plain copies into the peers'
receive buffers and needs three things from a transport, all per rank of one host:

* **buffers**: per ubatch slot, three byte regions on every rank (received tokens, received
  routing rows, combined partial sums), which this rank can address on every peer. Each slot is
  allocated for a number of tokens per rank and reallocated larger when a dispatch needs more
  (:meth:`Transport.ensure`, collective: every rank decides from the same count table);
* **signals**: ``signal(dst, channel)`` after this rank's puts to ``dst``, ``wait(src,
  channel)`` before the data from ``src`` is read. Signals are flags that go 0 -> 1 (signal)
  and 1 -> 0 (wait), so a second signal on a channel waits until the first was consumed;
* **the board** (:mod:`dbo.peers.hostboard`): a host-memory table through which the ranks
  publish the token counts of each dispatch. A copy needs its size on the host when it is
  issued, and the counts are on the host already (the number of rows of each rank's input), so
  the ranks exchange them through POSIX shared memory: no collective and no device sync.

:class:`CudaTransport` puts with ``Tensor.copy_`` into ``torch.distributed._symmetric_memory``
buffers of the peers (the copy engine moves them over NVLink, using no SMs) and signals with the
symmetric memory's one-thread ``put_signal``/``wait_signal`` kernels, which trap after
``timeout_s``. :class:`CpuTransport` keeps everything in shared memory and waits on the host
with the same timeout; it is the CPU stand-in the tests run on gloo, with the same layout and
protocol.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dbo.errors import CollectiveTimeoutError
from dbo.peers.hostboard import HostBoard, align, open_shared, open_shared_with_pids
from dbo.peers.watchdog import resolve_timeout

from .host import check_one_host

__all__ = ["BufferLayout", "CAPACITY_STEP", "grown_capacity", "Transport", "CpuTransport",
           "CudaTransport", "TransportCache", "TRANSPORTS", "open_transport", "symm_mem_rendezvous",
           "device_wait_fault", "failed_wait"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets of one ubatch slot's regions, sized for ``max_tokens`` tokens per rank.

    ``x``: ``[world * max_tokens, hidden]`` received tokens (``x_elem_bytes`` each: 1 for an fp8
    dispatch, else ``elem_bytes``);
    ``meta``: ``[world * max_tokens, 2 * max_topk + scale_cols]`` int32 routing rows (ids,
    float32 weights, then an fp8 dispatch's float32 block scales);
    ``comb``: ``[world * max_tokens, hidden]`` partial sums sent back by the experts' ranks
    (``elem_bytes`` each).
    """

    world_size: int
    max_tokens: int
    hidden: int
    elem_bytes: int
    max_topk: int
    x_elem_bytes: int | None = None  #: None: ``elem_bytes``
    scale_cols: int = 0

    @property
    def rows(self) -> int:
        return self.world_size * self.max_tokens

    @property
    def x_bytes(self) -> int:
        return align(self.rows * self.hidden * (self.x_elem_bytes or self.elem_bytes))

    @property
    def meta_bytes(self) -> int:
        return align(self.rows * (2 * self.max_topk + self.scale_cols) * 4)

    @property
    def comb_bytes(self) -> int:
        return align(self.rows * self.hidden * self.elem_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.x_bytes + self.meta_bytes + self.comb_bytes

    def offset(self, region: str) -> int:
        return {"x": 0, "meta": self.x_bytes, "comb": self.x_bytes + self.meta_bytes}[region]

    def with_tokens(self, max_tokens: int) -> BufferLayout:
        return dataclasses.replace(self, max_tokens=max_tokens)


#: capacities are multiples of this many tokens per rank
CAPACITY_STEP = 16


def grown_capacity(needed: int, current: int) -> int:
    """Tokens per rank a slot is (re)allocated for when a dispatch needs ``needed`` and it holds
    ``current``: the need, and at least twice the current size (a batch that grows step by step
    reallocates a logarithmic number of times), rounded up to :data:`CAPACITY_STEP`."""
    want = max(needed, 2 * current, 1)
    return -(-want // CAPACITY_STEP) * CAPACITY_STEP


class Transport:
    """Buffers and signals of one rank; see the module docstring.

    ``seq[slot]`` counts the dispatches of each slot and ``last_wait[slot]`` holds the event
    after the slot's latest GPU wait: they belong to the buffers, not to one backend object,
    since several backends (one per MoE layer) may share a transport. ``layouts[slot]`` is the
    slot's current size (None before its first allocation).
    """

    rank: int
    world_size: int
    timeout_s: float  # the built-in wait limit (a collective_timeout() block overrides it per call)
    layout: BufferLayout  # the shape of every slot; its max_tokens is unused
    board: HostBoard
    cuda: bool

    def _init_state(self, num_slots: int) -> None:
        self.seq = [0] * num_slots
        self.last_wait: dict[int, tuple[Any, str]] = {}
        self.layouts: list[BufferLayout | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.layouts)

    def capacity(self, slot: int) -> int:
        """Tokens per rank that ``slot``'s buffers hold now (0: not allocated yet)."""
        layout = self.layouts[slot]
        return 0 if layout is None else layout.max_tokens

    def ensure(self, slot: int, tokens: int) -> bool:
        """Make ``slot`` hold ``tokens`` tokens per rank, reallocating it larger if it holds
        fewer (:func:`grown_capacity`); returns whether it did.

        Collective when it reallocates: every rank of the group must call it with the same
        arguments at the same point (the backend calls it right after the count exchange, from
        the same table on every rank), when no rank has data of this slot in flight."""
        current = self.capacity(slot)
        if tokens <= current:
            return False
        layout = self.layout.with_tokens(grown_capacity(tokens, current))
        self._allocate(slot, layout)
        self.layouts[slot] = layout
        logger.info("copy_engine: rank %d: ubatch slot %d now holds %d tokens per rank (%.1f MiB; "
                    "a call needed %d, it held %d)", self.rank, slot, layout.max_tokens,
                    layout.slot_bytes / 2**20, tokens, current)
        return True

    @property
    def total_bytes(self) -> int:
        """Bytes of every slot's buffers on this rank."""
        return sum(layout.slot_bytes for layout in self.layouts if layout is not None)

    def _allocate(self, slot: int, layout: BufferLayout) -> None:
        raise NotImplementedError

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

    def __init__(self, group: Any, layout: BufferLayout, num_slots: int, timeout_s: float):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.layout = layout
        self.timeout_s = timeout_s
        num_channels = 2 * num_slots
        board = HostBoard.nbytes(num_slots)
        n = num_channels * self.world_size
        regions, pids = open_shared_with_pids(group, board + align(n * 4), "cpu")
        self.board = HostBoard(regions, self.rank, num_slots, timeout_s, "copy_engine", pids=pids)
        self._flags = [r[board:board + 4 * n].view(torch.int32).numpy()
                       .reshape(num_channels, self.world_size) for r in regions]
        self._data: list[list[torch.Tensor] | None] = [None] * num_slots
        self._init_state(num_slots)

    def _allocate(self, slot, layout):
        self._data[slot] = open_shared(self.group, layout.slot_bytes, f"s{slot}")

    def region(self, peer, slot, name, nbytes, offset=0):
        start = self.layouts[slot].offset(name) + offset
        return self._data[slot][peer][start:start + nbytes]

    def _spin(self, flag: np.ndarray, idx: tuple[int, int], want: int, what: str) -> None:
        timeout_s = resolve_timeout(self.timeout_s)  # a collective_timeout() block overrides it
        deadline = time.monotonic() + timeout_s
        spins = 0
        while int(flag[idx]) != want:
            spins += 1
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(f"copy_engine: rank {self.rank} {what} for more than "
                                             f"{timeout_s:.1f} s: the peer died or fell out "
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


def symm_mem_rendezvous(nbytes: int, device: torch.device, group: Any) -> tuple[torch.Tensor, Any]:
    """A symmetric-memory buffer of ``nbytes`` on CUDA ``device`` for every rank of ``group``
    (None: the default group), and its handle. Collective: every rank of the group calls it.

    Returns:
        ``(buffer, handle)``: this rank's ``[nbytes]`` uint8 buffer and torch's
        ``_SymmetricMemory`` handle (``handle.get_buffer(rank, shape, dtype, offset)`` maps a
        peer's buffer, ``handle.barrier()`` waits for every rank, and a signal pad).
    """
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch, deprecated (a no-op) by newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable((group or dist.group.WORLD).group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    # The allocation zeroes its signal pad with a copy that, in some torch versions, is queued
    # on the device's legacy stream and not waited for. Queued behind a busy step, it could run
    # after a peer had already signalled into the pad and wipe that signal: the wait for it then
    # traps after the timeout, on both ranks, in a step with no fault. The rendezvous is what
    # shows the pad to the peers, so the zeroing must be done before it.
    torch.cuda.synchronize(device)
    return buf, symm_mem.rendezvous(buf, group or dist.group.WORLD)


class CudaTransport(Transport):
    """Symmetric memory of one host: puts are copy-engine copies into the peers' buffers.

    Each ubatch slot has its own symmetric allocation, whose signal pad carries that slot's two
    channels (dispatch, combine)."""

    cuda = True

    def __init__(self, group: Any, layout: BufferLayout, num_slots: int, timeout_s: float,
                 device: torch.device):
        self.group = group
        self.device = device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.layout = layout
        self.timeout_s = timeout_s
        board = HostBoard.nbytes(num_slots)
        regions, pids = open_shared_with_pids(group, board, "board")
        self.board = HostBoard(regions, self.rank, num_slots, timeout_s, "copy_engine", pids=pids)
        self._slots: list[tuple[torch.Tensor, Any, list[torch.Tensor]] | None] = [None] * num_slots
        self._init_state(num_slots)

    def _allocate(self, slot, layout):
        if self._slots[slot] is not None:
            # this rank's queued puts into the old buffers and waits on the old signal pad must
            # finish before they go; the rendezvous below then orders every rank after its own
            torch.cuda.synchronize(self.device)
        buf, handle = symm_mem_rendezvous(layout.slot_bytes, self.device, self.group)
        pad = handle.get_signal_pad(self.rank).numel() * 4
        if 2 * self.world_size * 4 > pad:
            raise ValueError(f"the symmetric memory signal pad ({pad} bytes) is too small for two "
                             f"channels of {self.world_size} ranks")
        peers = [buf if r == self.rank else handle.get_buffer(r, (layout.slot_bytes,), torch.uint8, 0)
                 for r in range(self.world_size)]
        self._slots[slot] = (buf, handle, peers)

    def region(self, peer, slot, name, nbytes, offset=0):
        start = self.layouts[slot].offset(name) + offset
        return self._slots[slot][2][peer][start:start + nbytes]

    def _timeout_ms(self) -> int:
        # a collective_timeout() block overrides the built-in limit
        return max(int(resolve_timeout(self.timeout_s) * 1000), 1)

    def signal(self, dst, channel):
        self._slots[channel // 2][1].put_signal(dst, channel % 2, self._timeout_ms())

    def wait(self, src, channel):
        self._slots[channel // 2][1].wait_signal(src, channel % 2, self._timeout_ms())


class TransportCache:
    """The live transports, one per (group, device, slot shape, slots, timeout): every MoE layer
    of a model builds its own backend, and they share one set of buffers (48 layers of
    Qwen3-30B-A3B would otherwise hold 48 sets). Every rank must build its backends with the
    same arguments in the same order (as it must for DeepEP's shared buffer), so that all ranks
    find or all create a transport together. Held strongly, on purpose: freeing on the last
    backend's death would depend on when each rank's garbage collector runs, and a rank that
    still held its transport would find it while another created a new one (a collective) and
    hung. :meth:`reset` frees them (on every rank, with no backend in use)."""

    def __init__(self) -> None:
        self._live: dict[tuple, Transport] = {}

    def get(self, group: Any, layout: BufferLayout, num_slots: int, timeout_s: float,
            device: torch.device) -> Transport:
        name = (group or dist.group.WORLD).group_name
        shape = layout.with_tokens(0)  # any capacity: the slots grow
        key = (name, str(device), shape, num_slots, timeout_s)
        hit = self._live.get(key)
        if hit is None:
            hit = _open(group, shape, num_slots, timeout_s, device)
            self._live[key] = hit
        return hit

    def __len__(self) -> int:
        return len(self._live)

    def transports(self) -> list[Transport]:
        """The live transports."""
        return list(self._live.values())

    def reset(self) -> None:
        """Forget every transport, so that their buffers are freed once no backend holds them."""
        self._live.clear()


#: the process's shared copy-engine transports (see :class:`TransportCache`)
TRANSPORTS = TransportCache()


def _open(group: Any, layout: BufferLayout, num_slots: int, timeout_s: float,
          device: torch.device) -> Transport:
    check_one_host(group, device.type == "cuda")
    if device.type == "cuda":
        return CudaTransport(group, layout, num_slots, timeout_s, device)
    return CpuTransport(group, layout, num_slots, timeout_s)


def open_transport(group: Any, layout: BufferLayout, num_slots: int, timeout_s: float,
                   device: torch.device) -> Transport:
    """The transport for ``device`` with ``num_slots`` ubatch slots of ``layout``'s shape, shared
    with the other backends of the same group and shape, every slot holding at least
    ``layout.max_tokens`` tokens per rank (0: allocated at the first dispatch). Collective the
    first time and when it allocates: every rank of ``group`` calls it with the same arguments."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the copy_engine backend runs on cuda or cpu, not {device.type}")
    transport = TRANSPORTS.get(group, layout, num_slots, timeout_s, device)
    for slot in range(num_slots):
        transport.ensure(slot, layout.max_tokens)
    return transport


def failed_wait(rank: int, timeout_s: float, event: Any, what: str) -> CollectiveTimeoutError | None:
    """The named error of a copy-engine GPU wait (``event`` recorded after it) that trapped, the
    CUDA error as its cause; None if the event is fine. After the trap every CUDA call fails."""
    try:
        event.query()
    except RuntimeError as exc:
        err = CollectiveTimeoutError(
            f"copy_engine: rank {rank}'s GPU wait for {what} failed, most likely after "
            f"timeout_s={timeout_s:.1f} s without the peer's signal (the peer died, stalled or fell "
            f"out of step); the CUDA context is unusable from here ({exc})")
        err.__cause__ = exc
        return err
    return None


def gpu_waits_live() -> bool:
    """Whether a live copy-engine transport waits for its peers on the GPU (CUDA): a wait that
    traps after its timeout, so that a peer's failure shows at the next CUDA call anywhere."""
    return any(transport.cuda for transport in TRANSPORTS.transports())


def device_wait_fault() -> CollectiveTimeoutError | None:
    """The named error for a CUDA error that a copy-engine GPU wait caused: its wait for a peer's
    signal traps after ``timeout_s`` (the peer died or stalled), which leaves the CUDA context
    unusable, so the next CUDA call anywhere (a sync, an ``.item()``) fails with a bare "unspecified
    launch failure". None if no copy-engine wait is known to have failed. Call it when such an
    error reached you (the transformers integration does); the process must end either way."""
    for transport in TRANSPORTS.transports():
        for _, (event, what) in sorted(transport.last_wait.items()):
            err = failed_wait(transport.rank, transport.timeout_s, event, what)
            if err is not None:
                return err
    return None
