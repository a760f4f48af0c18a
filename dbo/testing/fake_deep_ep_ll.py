"""The low-latency mode of the fake ``deep_ep.Buffer`` (see :mod:`dbo.testing.fake_deep_ep`).

Dispatch sends every rank's (padded) tokens and top-k ids to every rank with one asynchronous
gloo all-to-all; the receive (DeepEP's recv phase, or the recv hook) waits for it and packs the
tokens of each local expert at the front of its slab, in (source rank, token) order. Combine
sends each expert's output back to the token's rank, where the receive sums them weighted by
``topk_weights`` in top-k order (float32 accumulation, like DeepEP). :class:`LLSlots` models
DeepEP's two low-latency receive buffers: a receive that runs after its buffer was reused or
cleaned raises ``FakeDeepEPError`` (on a GPU it would hang or read garbage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dbo.testing.fake_deep_ep_core import (
    EventOverlap,
    Kernel,
    check,
    fill_garbage,
    from_bytes,
    to_bytes,
    topk_idx_t,
)

__all__ = ["LL_HIDDEN", "LLSlots", "ll_dispatch", "ll_combine"]

#: the hidden sizes DeepEP's low-latency kernels are compiled for
LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)


# ---- the two receive buffers --------------------------------------------------------------


@dataclass
class _LLOp:
    """One low-latency launch: its sequence number, and the receive that completes it."""

    seq: int
    kind: str
    finish_recv: Callable[[], None]
    received: bool = False
    clobbered_by: int | None = None


@dataclass
class LLSlots:
    """A buffer's two low-latency receive slots: each launch uses one and cleans the other."""

    idx: int = 0
    seq: int = 0
    slots: list[_LLOp | None] = field(default_factory=lambda: [None, None])

    def launch(self, kind: str, finish_recv: Callable[[], None]) -> _LLOp:
        self.seq += 1
        use, clean = self.idx, self.idx ^ 1
        self.idx ^= 1
        for s in (use, clean):
            old = self.slots[s]
            if old is not None and not old.received and old.clobbered_by is None:
                old.clobbered_by = self.seq
        op = _LLOp(self.seq, kind, finish_recv)
        self.slots[use] = op
        return op

    def receive(self, op: _LLOp) -> None:
        check(not op.received, f"the receive of low-latency {op.kind} #{op.seq} ran twice")
        check(op.clobbered_by is None,
              f"the receive of low-latency {op.kind} #{op.seq} ran after launch #{op.clobbered_by} "
              "reused or cleaned its buffer (DeepEP keeps two low-latency buffers; on a GPU this "
              "hangs or reads garbage)")
        op.finish_recv()
        op.received = True


# ---- dispatch and combine ----------------------------------------------------------------


def _fp8_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel fp8 cast: ``[N, H]`` -> fp8 ``[N, H]``, ``[N, H/128]``."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(n, h)
    return q, amax / 448.0


def _send_all(buf: Any, payload: torch.Tensor) -> tuple[torch.Tensor, Any]:
    r = buf.group_size
    recv = torch.empty((r * payload.shape[0], payload.shape[1]), dtype=torch.uint8)
    work = dist.all_to_all_single(recv, payload.repeat(r, 1), group=buf.group, async_op=True)
    return recv, work


def ll_dispatch(buf: Any, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
                stats: torch.Tensor | None, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                async_finish: bool, return_recv_hook: bool) -> tuple:
    check(buf.low_latency_mode, "low_latency_dispatch needs a buffer made with low_latency_mode=True")
    check(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16, "x must be 2-D contiguous bf16")
    hidden = x.shape[1]
    check(hidden % 128 == 0 and hidden in LL_HIDDEN, f"Unsupported hidden {hidden}")
    check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t,
          "topk_idx must be 2-D contiguous int64")
    check(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= max_tokens,
          f"{x.shape[0]} tokens for num_max_dispatch_tokens_per_rank={max_tokens}")
    check(topk_idx.shape[1] <= 11, "num_topk must be <= 11")
    r = buf.group_size
    check(num_experts % r == 0, "num_experts must be a multiple of the group size")
    check((r * max_tokens) % 4 == 0, "TMA requires the number of tokens to be multiple of 4")
    check(buf.nvshmem_qp_depth >= (max_tokens + 1) * 2, "NVSHMEM QP depth too small")
    check(not (async_finish and return_recv_hook), "async_finish and return_recv_hook exclude each other")
    check(not use_ue8m0 and not round_scale, "round_scale/use_ue8m0 are not modelled by the fake")
    if use_fp8:
        check(hidden % 512 == 0, "fp8 needs hidden % 512 == 0")
    n_local = num_experts // r
    kernel = Kernel(buf.comm_stream, None, async_finish, False, on_current_stream=return_recv_hook)
    t, k = topk_idx.shape
    payload = torch.zeros((max_tokens + 1, hidden * 2 + 8 * k), dtype=torch.uint8)
    payload[:t, : hidden * 2] = to_bytes(x)
    payload[:t, hidden * 2:] = to_bytes(topk_idx)
    payload[max_tokens, :8] = to_bytes(torch.tensor([[t]], dtype=torch.int64))
    recv, work = _send_all(buf, payload)

    cap = r * max_tokens
    packed_x = fill_garbage(torch.empty((n_local, cap, hidden),
                                        dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16))
    scales = (fill_garbage(torch.empty((n_local, hidden // 128, cap), dtype=torch.float32)).transpose(1, 2)
              if use_fp8 else None)
    count = fill_garbage(torch.empty((n_local,), dtype=torch.int32))
    src_info = fill_garbage(torch.empty((n_local, cap), dtype=torch.int32))
    layout_range = fill_garbage(torch.empty((n_local, r), dtype=torch.int64))

    def finish_recv() -> None:
        work.wait()
        filled = [0] * n_local
        for s in range(r):
            block = recv[s * (max_tokens + 1):(s + 1) * (max_tokens + 1)]
            ts = int(from_bytes(block[max_tokens:, :8], torch.int64, (1,)).item())
            xs = from_bytes(block[:ts, : hidden * 2], torch.bfloat16, (hidden,))
            ids = from_bytes(block[:ts, hidden * 2:], torch.int64, (k,))
            for e in range(n_local):
                tokens = torch.nonzero((ids == buf.rank * n_local + e).any(dim=1)).flatten()
                c, begin = tokens.numel(), filled[e]
                if c:
                    if use_fp8:
                        q, sc = _fp8_cast(xs[tokens])
                        packed_x[e, begin:begin + c] = q
                        scales[e, begin:begin + c] = sc
                    else:
                        packed_x[e, begin:begin + c] = xs[tokens]
                    src_info[e, begin:begin + c] = tokens.to(torch.int32)
                layout_range[e, s] = (begin << 32) | c
                filled[e] += c
        count.copy_(torch.tensor(filled, dtype=torch.int32))
        if stats is not None:
            stats.add_(count)

    op = buf.ll_slots.launch("dispatch", finish_recv)
    handle = (src_info, layout_range, max_tokens, hidden, num_experts)
    recv_x = (packed_x, scales) if use_fp8 else packed_x
    if return_recv_hook:
        return recv_x, count, handle, EventOverlap(None), lambda: buf.ll_slots.receive(op)
    buf.ll_slots.receive(op)
    return recv_x, count, handle, kernel.finish((x, topk_idx, packed_x, count)), None


def ll_combine(buf: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               handle: tuple, async_finish: bool, return_recv_hook: bool,
               out: torch.Tensor | None) -> tuple:
    check(buf.low_latency_mode, "low_latency_combine needs a buffer made with low_latency_mode=True")
    src_info, layout_range, max_tokens, hidden, num_experts = handle
    r = buf.group_size
    n_local = num_experts // r
    check(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16, "x must be 3-D contiguous bf16")
    check(tuple(x.shape) == (n_local, r * max_tokens, hidden),
          f"x must be [{n_local}, {r * max_tokens}, {hidden}], got {list(x.shape)}")
    check(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t,
          "topk_idx must be 2-D contiguous int64")
    check(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
          and topk_weights.shape == topk_idx.shape, "topk_weights must be contiguous float32 like topk_idx")
    t, k = topk_idx.shape
    check(t <= max_tokens, f"{t} combined tokens for num_max_dispatch_tokens_per_rank={max_tokens}")
    check(not (async_finish and return_recv_hook), "async_finish and return_recv_hook exclude each other")
    if out is not None:
        check(out.dim() == 2 and out.is_contiguous() and tuple(out.shape) == (t, hidden)
              and out.dtype == x.dtype, "out must be [num_combined_tokens, hidden] contiguous bf16")
    kernel = Kernel(buf.comm_stream, None, async_finish, False, on_current_stream=return_recv_hook)
    # a slot no row is sent to holds what the real receive buffer would: stale data (NaN here),
    # so reading a (token, expert) slot that was not sent shows up
    blocks = fill_garbage(torch.empty((r, max_tokens, n_local, hidden), dtype=torch.bfloat16))
    for e in range(n_local):
        for s in range(r):
            packed = int(layout_range[e, s])
            begin, c = packed >> 32, packed & 0xFFFFFFFF
            if c:
                tokens = src_info[e, begin:begin + c].to(torch.long)
                blocks[s, tokens, e] = x[e, begin:begin + c]
    payload = to_bytes(blocks.view(r * max_tokens, n_local * hidden))
    recv = torch.empty_like(payload)
    work = dist.all_to_all_single(recv, payload, group=buf.group, async_op=True)
    combined = out if out is not None else torch.empty((t, hidden), dtype=torch.bfloat16)
    fill_garbage(combined)

    def finish_recv() -> None:
        work.wait()
        got = from_bytes(recv, torch.bfloat16, (n_local * hidden,)).view(r, max_tokens, n_local, hidden)
        acc = torch.zeros((t, hidden), dtype=torch.float32)
        rows = torch.arange(t)
        for j in range(k):
            g = topk_idx[:, j]
            valid = g >= 0
            vals = got[g[valid] // n_local, rows[valid], g[valid] % n_local].float()
            acc[valid] += topk_weights[valid, j].unsqueeze(1) * vals
        combined.copy_(acc)

    op = buf.ll_slots.launch("combine", finish_recv)
    if return_recv_hook:
        return combined, EventOverlap(None), lambda: buf.ll_slots.receive(op)
    buf.ll_slots.receive(op)
    return combined, kernel.finish((x, topk_idx, topk_weights, combined)), None
