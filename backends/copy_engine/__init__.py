"""Zero-SM intranode prepare/finalize: copy-engine puts into the peers' receive buffers.

Every rank of one host sends each of its tokens, with its routing row, to every rank
(``dispatch``); each rank runs its local experts on what it received, weighs and sums each
token's local top-k, and puts that partial sum back to the token's owner (``combine``), which
adds the ``world_size`` partial sums. The bytes move with plain ``Tensor.copy_`` into the peers'
``torch.distributed._symmetric_memory`` buffers, which the GPU's copy engines carry over NVLink:
no SM runs a communication kernel, so compute beside the transfer keeps the whole GPU (DeepEP's
normal mode holds 24-48 SMs for its kernels, and the compute beside them ran 15-36% slower on an
H200; docs/performance.md). Arrival is signalled with the symmetric memory's one-thread
``put_signal``/``wait_signal`` kernels; the receiver's wait sits on the compute stream right
before the data is read.

Why every token goes to every rank: a copy needs its size on the host when it is issued. The
number of rows a rank holds is on the host already; the number of rows it sends to one peer
(after routing) is on the GPU, and reading it would stall the CPU. With top-8 routing over two
ranks 99.6% of the tokens have an expert on both ranks anyway; over eight ranks 66%, so this
moves about 1.5x the bytes of an exact exchange there. Rows with no local expert cost the
experts nothing (their ids are ``-1``) and come back as zeros.

Where the host waits: in ``prepare``, for every peer's host to publish its token count of the
same dispatch (host shared memory, :class:`~dbo.peers.hostboard.HostBoard`); under DBO
the backend yields first, so the other ubatch's compute is queued on the GPU meanwhile. Nothing
reads anything back from the GPU. A peer that stops makes that wait raise
:class:`dbo.errors.CollectiveTimeoutError` after ``timeout_s``; a peer that stops between its
count and its data makes the GPU wait trap after the same timeout, and the next call of this
backend raises ``CollectiveTimeoutError`` naming it.

Buffers are per ubatch slot, shared by every backend built with the same group and shape (one
per MoE layer, typically), and reused across layers, steps and runs: a rank writes into a peer's
slot only after that peer's combine of the slot's previous dispatch arrived, which the peer sent
after its last read of the slot, so no overwrite can race a read. Nobody has to guess their size:
a slot is allocated at its first dispatch for the tokens that dispatch brings, and reallocated
larger (at least twice) when a later one brings more. The count exchange gives every rank the
same table, so every rank decides the same and reallocates at the same point (collective), right
after the exchange, when no data of that slot is in flight anywhere (each rank has consumed the
slot's previous combine before it can publish the next count). ``max_tokens_per_rank`` only
allocates ahead. After a failed step, build a new backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dbo.moe.base import PrepareResult, TopKWeightAndReduce
from dbo.moe.handles import PerUBatch
from dbo.ubatch.context import dbo_current_ubatch_id

from ..fp8 import FP8_BLOCK, dequantize_fp8_blocks, quantize_fp8_blocks
from ..torchdist import DTYPE_CODES, TorchDistPrepareAndFinalize
from .transport import BufferLayout, Transport, device_wait_fault, failed_wait, gpu_waits_live, open_transport

__all__ = ["CopyEnginePrepareAndFinalize", "make_prepare_finalize", "destinations", "PUT_ORDERS",
           "device_wait_fault", "gpu_waits_live"]

logger = logging.getLogger(__name__)

_DISPATCH, _COMBINE = 0, 1

#: the orders in which a rank visits its destinations (``put_order=``)
PUT_ORDERS = ("ring", "rank")


def destinations(rank: int, world_size: int, order: str = "ring") -> list[int]:
    """The ranks a rank puts to, in the order it puts. ``ring``: ``rank, rank + 1, ...`` (mod
    ``world_size``), so that at each step every rank writes into a different peer; ``rank``:
    ``0, 1, ..., world_size - 1``, so that every rank writes into the same peer at once (on 4
    H100s the slower: 3.81 ms against 2.04 ms for 235 MB to every rank; docs/performance.md)."""
    if order == "ring":
        return [(rank + i) % world_size for i in range(world_size)]
    if order == "rank":
        return list(range(world_size))
    raise ValueError(f"put_order must be one of {PUT_ORDERS}, got {order!r}")


def _nothing() -> None:
    pass


@dataclass
class _Handle:
    counts: list[int]       # tokens of every rank in this dispatch
    offsets: list[int]      # first received row of each rank
    seq: int
    hidden: int


class CopyEnginePrepareAndFinalize(TorchDistPrepareAndFinalize):
    """Dispatch and combine by copy-engine puts between the ranks of one host (STANDARD format).

    ``prepare`` returns ``a1q`` ``[M_recv, hidden]`` (a view of this rank's receive buffer,
    valid until this ubatch's ``finalize``): the tokens of rank 0, then rank 1's, ...;
    ``M_recv`` is the sum of every rank's token count. ``topk_ids`` ``[M_recv, topk]`` int64
    LOCAL ids (``-1`` for experts on other ranks), ``topk_weights`` ``[M_recv, topk]`` float32
    (0 where the id is ``-1``). ``finalize`` weighs and sums each received token's local top-k
    (unless the experts did), puts the ``[M_s, hidden]`` partial sums back to each rank ``s``
    and adds the ``world_size`` partial sums of this rank's tokens into ``output`` (float32
    accumulation). Experts are placed contiguously (rank ``r`` holds ``[r * L, (r + 1) * L)``).

    Args:
        group: the expert-parallel group; every rank on this host (checked: a group that spans
            hosts is refused with ``ValueError``).
        hidden_size: the hidden size of every call.
        max_tokens_per_rank: tokens per rank to allocate every slot for at construction (None:
            at the first dispatch); not a limit, the buffers grow when a call brings more.
        max_topk: the largest ``topk`` of any call.
        dtype: the largest activation dtype the buffers hold (bf16 buffers take bf16/fp16 calls;
            float32 buffers take all three).
        num_ubatches: buffer slots, one per ubatch id (a run with more ubatches is refused).
        device: ``cuda`` (symmetric memory, copy engines) or ``cpu`` (host shared memory, the
            stand-in the tests use); default the current CUDA device if any.
        timeout_s: the longest wait for a peer (host and GPU) before failing.
        check_inputs: check argument types, shapes and the ``topk_ids`` range (the range is read
            at the first call only: on GPU a device sync).
        put_order: ``"ring"`` (default: rank ``r`` puts to ``r, r + 1, ...``, so the ranks write
            into different peers at each moment) or ``"rank"`` (``0, 1, ...``: every rank into
            the same peer at once; kept to measure the difference). Results are the same bits.
        use_fp8_dispatch: send the tokens as fp8 (e4m3) with one float32 scale per 128 elements
            (DeepEP's block layout, ``hidden_size % 128 == 0``): 1 + 4/128 bytes an element where
            bf16 takes 2. The combine stays in the activations' dtype. Opt-in: the tokens reach
            the experts rounded (see docs/backends.md for the error against bf16).
        dequantize_received: with fp8, hand the experts the activations' dtype (default), or
            the fp8 tokens with ``a1q_scale`` ``[M_recv, hidden // 128]`` for experts that take
            them (:class:`dbo.experts.SwiGLUExperts` does).
    """

    name = "copy_engine"

    def __init__(self, group: Any = None, *, hidden_size: int, max_tokens_per_rank: int | None = None,
                 max_topk: int = 8, dtype: torch.dtype = torch.bfloat16, num_ubatches: int = 2,
                 device: torch.device | str | None = None, timeout_s: float = 60.0,
                 check_inputs: bool = True, put_order: str = "ring", use_fp8_dispatch: bool = False,
                 dequantize_received: bool = True):
        super().__init__(group, hidden_size=hidden_size, timeout_s=timeout_s,
                         check_inputs=check_inputs, use_async=True)
        self.order = destinations(self.rank, self.world_size, put_order)
        self.put_order = put_order
        for key, val in (("hidden_size", hidden_size), ("max_tokens_per_rank", max_tokens_per_rank or 1),
                         ("max_topk", max_topk), ("num_ubatches", num_ubatches)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{key} must be a positive int, got {val!r}")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {sorted(map(str, DTYPE_CODES))}, got {dtype}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        if use_fp8_dispatch and hidden_size % FP8_BLOCK:
            raise ValueError(f"use_fp8_dispatch needs hidden_size % {FP8_BLOCK} == 0, got {hidden_size}")
        self.max_topk = max_topk
        self.elem_bytes = dtype.itemsize
        self.num_ubatches = num_ubatches
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.dequantize_received = bool(dequantize_received)
        self.layout = BufferLayout(self.world_size, max_tokens_per_rank or 0, hidden_size,
                                   self.elem_bytes, max_topk,
                                   x_elem_bytes=1 if self.use_fp8_dispatch else None,
                                   scale_cols=hidden_size // FP8_BLOCK if self.use_fp8_dispatch else 0)
        self.transport: Transport = open_transport(group, self.layout, num_ubatches,
                                                   self.timeout_s, self.device)
        self._handles: PerUBatch[_Handle] = PerUBatch("copy_engine dispatch handle")
        logger.info("copy_engine: rank %d of %d on %s, %.1f MiB of buffers so far", self.rank,
                    self.world_size, self.device, self.transport.total_bytes / 2**20)

    def reset(self) -> None:
        self._handles.clear()

    # ---- helpers --------------------------------------------------------------------------

    def _slot(self) -> int:
        ub = dbo_current_ubatch_id()
        if ub >= self.num_ubatches:
            raise ValueError(f"copy_engine was built with num_ubatches={self.num_ubatches}; "
                             f"ubatch {ub} has no buffer slot (build it with more)")
        return ub

    def _view(self, peer: int, slot: int, region: str, row0: int, rows: int, cols: int,
              dtype: torch.dtype) -> torch.Tensor:
        size = dtype.itemsize
        raw = self.transport.region(peer, slot, region, rows * cols * size, row0 * cols * size)
        return raw.view(dtype).view(rows, cols)

    def _raise_device_timeout(self, slot: int) -> None:
        """A GPU wait of this slot that trapped (a peer's data never came) surfaces here. Not
        while a CUDA graph captures: querying an event would end the capture."""
        if torch.cuda.is_current_stream_capturing():
            return
        last = self.transport.last_wait.pop(slot, None)
        if last is None:
            return
        err = failed_wait(self.rank, self.timeout_s, *last)
        if err is not None:
            raise err

    def _put_all(self, slot: int, puts: list[tuple[int, str, int, torch.Tensor]],
                 channel: int) -> Any:
        """Put each ``(dst, region, row0, src)``, in the order given: ``src`` ``[rows, cols]`` at
        row ``row0`` of ``dst``'s region (a dense ``[*, cols]`` view, so every put is one
        contiguous copy), then signal every peer. Returns an event after the puts (CUDA), or None.
        The puts run one after another on the current stream: with ``put_order="ring"`` the
        copy to this rank itself goes first and the peers follow in ring order."""
        for dst, region, row0, src in puts:
            if src.shape[0]:
                self._view(dst, slot, region, row0, src.shape[0], src.shape[1], src.dtype).copy_(src)
        own = None
        if self.transport.cuda:
            own = torch.cuda.Event()
            own.record()
        for dst in self.order:
            if dst != self.rank:
                self.transport.signal(dst, channel)
        return own

    def _wait_all(self, slot: int, channel: int, own: Any, what: str) -> None:
        """Make the current stream (or, on CPU, the host) wait for every peer's signal."""
        for src in range(self.world_size):
            if src != self.rank:
                self.transport.wait(src, channel)
        if own is not None:
            torch.cuda.current_stream().wait_event(own)
            if not torch.cuda.is_current_stream_capturing():  # a captured event never runs eagerly
                done = torch.cuda.Event()
                done.record()
                self.transport.last_wait[slot] = (done, what)

    def _arrival(self, slot: int, channel: int, own: Any, what: str
                 ) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(hook, stream_wait)`` for the peers' signals on ``channel``: on CPU the hook waits
        on the host and ``stream_wait`` does nothing; on CUDA the hook is only the yield point and
        ``stream_wait`` (called by the receiver, right before the data is read) queues the waits
        on the compute stream."""
        def wait() -> None:
            self._wait_all(slot, channel, own, what)

        return (_nothing, wait) if self.transport.cuda else (wait, _nothing)

    # ---- dispatch -------------------------------------------------------------------------

    def dispatch_holds_stream(self) -> bool:
        # the puts are copies queued on the current stream: work after them waits for them
        return self.transport.cuda

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        n_local = self._check(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input)
        self._check_expert_map(expert_map, num_experts)
        slot = self._slot()
        if self.transport.cuda:
            self._raise_device_timeout(slot)
        x = self._router_on_input(a1, topk_weights, apply_router_weight_on_input).contiguous()
        m, hidden = x.shape
        topk = topk_ids.shape[1]
        routing = [topk_ids.to(torch.int32), topk_weights.to(torch.float32).view(torch.int32)]
        if self.use_fp8_dispatch:  # the tokens as fp8 bytes, their block scales behind the routing
            q, scales = quantize_fp8_blocks(x)
            routing.append(scales.view(torch.int32))
            payload = q.view(torch.uint8)
        else:
            payload = x
        meta = torch.cat(routing, dim=1)
        # The host is about to wait for its peers' hosts: let the other ubatch queue its compute.
        with self.comm_section(back="plain") as comm:
            self.transport.seq[slot] += 1
            seq = self.transport.seq[slot]
            rows = self.transport.board.exchange(
                slot, seq, [m, hidden, topk, DTYPE_CODES.get(x.dtype, -1), num_experts])
            counts = self._agree(rows, x.dtype, topk)
            self.transport.ensure(slot, max(counts))  # the same decision on every rank
            offsets = [sum(counts[:r]) for r in range(self.world_size)]
            me = offsets[self.rank]
            chan = 2 * slot + _DISPATCH
            own_x = self._put_all(slot, [p for d in self.order
                                         for p in ((d, "x", me, payload), (d, "meta", me, meta))], chan)
            self._handles.put(_Handle(counts, offsets, seq, hidden))
            comm.keep(payload, meta)  # the comm stream reads them after the caller moves on
        total = sum(counts)
        lo = self.rank * n_local
        dtype = x.dtype

        hook, stream_wait = self._arrival(slot, chan, own_x, f"dispatch {seq} of ubatch {slot}")

        fp8 = self.use_fp8_dispatch
        meta_cols = 2 * topk + (hidden // FP8_BLOCK if fp8 else 0)

        def receiver() -> PrepareResult:
            stream_wait()
            mr = self._view(self.rank, slot, "meta", 0, total, meta_cols, torch.int32)
            ids = mr[:, :topk].to(torch.int64)
            weights = mr[:, topk:2 * topk].contiguous().view(torch.float32)
            mine = (ids >= lo) & (ids < lo + n_local)
            local = torch.where(mine, ids - lo, -1)
            weights = torch.where(mine, weights, 0.0)
            scales = None
            if fp8:
                xr = self._view(self.rank, slot, "x", 0, total, hidden, torch.uint8).view(torch.float8_e4m3fn)
                scales = mr[:, 2 * topk:].contiguous().view(torch.float32)
                if self.dequantize_received:
                    xr, scales = dequantize_fp8_blocks(xr, scales, dtype), None
            else:
                xr = self._view(self.rank, slot, "x", 0, total, hidden, dtype)
            return PrepareResult(xr, scales, None, local, weights)

        return hook, receiver

    def _agree(self, rows: list[list[int]], dtype: torch.dtype, topk: int) -> list[int]:
        """Every rank's token count, after checking that the ranks' calls agree and fit the
        buffers' shape (the token counts fit any: the slot grows). Every rank sees the same
        table, so every rank raises the same error."""
        names = ("hidden size", "topk", "dtype code", "num_experts")
        for col, name in enumerate(names, start=1):
            vals = [r[col] for r in rows]
            if len(set(vals)) > 1:
                raise ValueError(f"copy_engine: {name} differs across ranks: "
                                 + ", ".join(f"rank {i}={v}" for i, v in enumerate(vals)))
        counts = [r[0] for r in rows]
        problems = []
        if topk > self.max_topk:
            problems.append(f"topk={topk} exceeds max_topk={self.max_topk}")
        if dtype.itemsize > self.elem_bytes:
            problems.append(f"dtype {dtype} is wider than the buffers' ({self.elem_bytes} bytes)")
        if problems:
            raise ValueError("copy_engine: " + "; ".join(problems) + " (build the backend larger)")
        return counts

    # ---- combine --------------------------------------------------------------------------

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce: TopKWeightAndReduce):
        h = self._handles.take()
        slot = self._slot()
        m = h.counts[self.rank]
        y = self._weighted_output(output, m, h.hidden, fused_expert_output, topk_weights, topk_ids,
                                  apply_router_weight_on_input, weight_and_reduce)
        total = sum(h.counts)
        if y.shape[0] != total:
            raise ValueError(f"fused_expert_output reduces to {y.shape[0]} rows, but {total} were "
                             "dispatched to this rank")
        with self.comm_section(yield_first=False, back="plain") as comm:
            chan = 2 * slot + _COMBINE
            # partial sums of rank s's tokens go to rows [rank * M_s, (rank + 1) * M_s) of s
            own = self._put_all(slot, [(s, "comb", self.rank * h.counts[s],
                                        y[h.offsets[s]:h.offsets[s] + h.counts[s]])
                                       for s in self.order], chan)
            comm.keep(y)
        hook, stream_wait = self._arrival(slot, chan, own, f"combine {h.seq} of ubatch {slot}")

        def receiver() -> None:
            stream_wait()
            if not m:
                return
            parts = self._view(self.rank, slot, "comb", 0, self.world_size * m, h.hidden, y.dtype)
            output.copy_(parts.view(self.world_size, m, h.hidden).sum(0, dtype=torch.float32))

        return hook, receiver


def make_prepare_finalize(group: Any = None, *, hidden: int, max_tokens_per_rank: int | None = None,
                          num_experts: int | None = None, topk: int = 8,
                          dtype: torch.dtype = torch.bfloat16, device: Any = None,
                          **kwargs: Any) -> CopyEnginePrepareAndFinalize:
    """The factory the other backends share (``num_experts`` is not needed here;
    ``max_tokens_per_rank`` only allocates ahead, the buffers grow as calls need)."""
    del num_experts
    return CopyEnginePrepareAndFinalize(group, hidden_size=hidden,
                                        max_tokens_per_rank=max_tokens_per_rank, max_topk=topk,
                                        dtype=dtype, device=device, **kwargs)
