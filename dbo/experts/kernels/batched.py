"""The BATCHED_EXPERTS layout (DeepEP low-latency's ``[L, cap, hidden]`` slabs) on the fused
experts' kernels: work for the rows that arrived, not for each expert's capacity.

In that layout expert ``e``'s rows are the first ``counts[e]`` of its slab ``x[e]``, counted on
the device only (reading them back would stall the host, and a CUDA graph cannot). Two batched
matmuls over the whole slab do ``cap / counts[e]`` times the work: on 4 ranks with 128 tokens
per rank the slab holds 512 rows per expert where about 128 arrive. Here the rows are sorted by
expert already, so one launch (:func:`batched_order`) writes each sorted row's place in the
slab and each expert's end row, the ``(order, offsets)`` pair of
:func:`dbo.experts.kernels.fused_route.route_order`, and the fused gate/up and down GEMMs of
:mod:`dbo.experts.kernels.fused_experts` run on it: their grid is bounded by the capacity, their
programs past the last expert's rows return at once, and the down GEMM writes each row back to
its slab place (rows past an expert's count are left unwritten, as the layout allows).

Segments (the merged schedule, :mod:`dbo.moe.merged`): several ubatches' slabs laid end to end
in one flat buffer ``[sum_u L * cap_u, hidden]``, region ``u`` at row ``base_u = L * sum(cap_v,
v < u)`` holding ubatch ``u``'s slab rows at the same places (:func:`dbo.kernels.row_copies.copy_arrived_rows`
copies only the rows that arrived there). :func:`batched_order` over the segments sorts expert ``e``'s
rows as ubatch 0's, then ubatch 1's, ..., and :func:`segmented_swiglu_experts` runs the experts
once over them: the down GEMM writes each row to its place in the flat output, whose region
``u`` is ubatch ``u``'s output slab as it is (a view, nothing copied back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dbo.experts.kernels.fused_experts import launch_down, launch_gate_up
from dbo.experts.kernels.fused_maps import block_e
from dbo.experts.kernels.fused_tiles import pick_slab_configs
from dbo.kernels.triton_launch import cdiv, launch
from dbo.moe.base import MAX_SEGMENTS, segment_bases

__all__ = ["batched_order", "batched_swiglu_experts", "segmented_swiglu_experts", "segment_bases",
           "MAX_SEGMENTS"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None

if triton is not None:

    @triton.jit
    def _batched_order_kernel(counts_ptr, stride_e, stride_u, order_ptr, offsets_ptr, n_experts,
                              n_rows, cap0, cap1, cap2, cap3, SEGMENTS: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
        # expert e's sorted rows are segment 0's counts[e, 0], then segment 1's, ...; row j of
        # expert e in segment u is flat row base_u + e * cap_u + j, base_u = L * sum(cap_v, v < u)
        pid = tl.program_id(0)
        us = tl.arange(0, 4)  # MAX_SEGMENTS
        caps = tl.where(us == 0, cap0, tl.where(us == 1, cap1, tl.where(us == 2, cap2, cap3)))
        caps = tl.where(us < SEGMENTS, caps, 0)
        bases = (tl.cumsum(caps, 0) - caps) * n_experts
        ex = tl.arange(0, BLOCK_E)
        live = ex < n_experts
        totals = tl.zeros([BLOCK_E], dtype=tl.int32)
        for u in tl.static_range(SEGMENTS):
            cap = tl.sum(tl.where(us == u, caps, 0), 0)
            c = tl.load(counts_ptr + ex * stride_e + u * stride_u, mask=live, other=0).to(tl.int32)
            totals += tl.minimum(tl.maximum(c, 0), cap)
        ends = tl.cumsum(totals, 0)
        if pid == 0:
            tl.store(offsets_ptr + ex, ends, mask=live)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        past = tl.where(live[None, :], ends[None, :] <= r[:, None], False)
        e = tl.minimum(tl.sum(past.to(tl.int32), 1), n_experts - 1)
        own = ex[None, :] == e[:, None]
        k = r - tl.sum(tl.where(own, (ends - totals)[None, :], 0), 1)  # row k of expert e's
        dest = tl.zeros([BLOCK_R], dtype=tl.int32)
        for u in tl.static_range(SEGMENTS):
            cap = tl.sum(tl.where(us == u, caps, 0), 0)
            c = tl.load(counts_ptr + ex * stride_e + u * stride_u, mask=live, other=0).to(tl.int32)
            n = tl.sum(tl.where(own, tl.minimum(tl.maximum(c, 0), cap)[None, :], 0), 1)
            base = tl.sum(tl.where(us == u, bases, 0), 0)
            dest = tl.where((k >= 0) & (k < n), base + e * cap + k, dest)
            k -= n
        tl.store(order_ptr + r, dest, mask=r < n_rows)



def batched_order(counts: torch.Tensor, cap: int | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offsets)`` of the rows that arrived in slabs whose expert ``e`` holds
    ``counts[e]`` rows (each count clamped to its slab's capacity). One launch, no host sync.

    One slab: ``counts`` ``[L]`` int on the device, ``cap`` an int; sorted row ``r`` of expert
    ``e`` -> its slab row ``e * cap + j``. Segments (several ubatches' slabs laid end to end,
    ``U <=`` :data:`MAX_SEGMENTS`): ``counts`` ``[L, U]``, ``cap`` the ``U`` capacities; expert
    ``e``'s sorted rows are segment 0's first ``counts[e, 0]``, then segment 1's, ..., each
    mapped to ``base_u + e * cap_u + j`` (:func:`segment_bases`).

    Returns:
        ``order`` int32 ``[L * sum(caps)]`` (past ``offsets[-1]`` unspecified) and ``offsets``
        int32 ``[L]``, each expert's end row.
    """
    caps = (cap,) if isinstance(cap, int) else tuple(int(c) for c in cap)
    if isinstance(cap, int) != (counts.dim() == 1) or counts.dim() not in (1, 2):
        raise ValueError(f"counts must be [L] with an int cap, or [L, U] with U caps; got "
                         f"{tuple(counts.shape)} and {cap!r}")
    n_experts = counts.shape[0] if counts.numel() else 0
    segs = counts.view(-1, 1) if counts.dim() == 1 else counts
    if segs.shape[1] != len(caps) or not 1 <= len(caps) <= MAX_SEGMENTS:
        raise ValueError(f"need 1 to {MAX_SEGMENTS} segments with a cap each, got counts "
                         f"{tuple(counts.shape)} and caps {caps}")
    n_rows = segment_bases(n_experts, caps)[-1]
    if n_experts == 0 or min(caps) < 0 or n_rows < 1:
        raise ValueError(f"need at least one expert and caps >= 0 with a row in all, got "
                         f"{n_experts} experts and caps {caps}")
    if n_rows >= 2**31:
        raise ValueError(f"{n_experts} experts' slabs of {caps} rows overflow int32 row indices")
    order = torch.empty(n_rows, dtype=torch.int32, device=counts.device)
    offsets = torch.empty(n_experts, dtype=torch.int32, device=counts.device)
    block_r = 128
    padded = caps + (0,) * (MAX_SEGMENTS - len(caps))
    launch(_batched_order_kernel, (cdiv(n_rows, block_r),), (
        segs, segs.stride(0), segs.stride(1), order, offsets, n_experts, n_rows, *padded), dict(
        SEGMENTS=len(caps), BLOCK_E=block_e(n_experts), BLOCK_R=block_r, num_warps=4))
    return order, offsets


def _experts(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
             w2: torch.Tensor, out: torch.Tensor, est: float, configs, persistent: bool | None,
             sm_carveout: int | None) -> None:
    # the fused GEMMs over x [R, hidden]: gather through order, scatter to out [R, hidden]
    pairs, _ = x.shape
    inter = w2.shape[2]
    up_cfg, down_cfg = pick_slab_configs(est, inter, w1.shape[0]) if configs is None else configs
    persistent = True if persistent is None else persistent
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x, order, offsets, w1, act, up_cfg, pairs, 1, persistent, sm_carveout=sm_carveout)
    launch_down(act, order, offsets, w2, out, down_cfg, pairs, persistent, sm_carveout=sm_carveout)


def _check_out(x: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def batched_swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, *,
                           out: torch.Tensor, rows_per_expert: float | None = None,
                           configs=None, persistent: bool | None = None,
                           sm_carveout: int | None = None) -> torch.Tensor:
    """SwiGLU experts on ``x`` ``[L, cap, hidden]`` (expert ``e``'s rows the first ``counts[e]``
    of ``x[e]``) into ``out`` (same shape; rows past the counts left unwritten). CUDA, Triton.

    ``rows_per_expert``: the caller's estimate of the rows that arrive per expert, for the tiles
    (default a quarter of ``cap``); ``configs``/``persistent``/``sm_carveout`` as for
    :func:`dbo.experts.kernels.fused_experts.fused_swiglu_experts` (default persistent: the grid's
    bound is the capacity, most of it empty). Returns ``out``; nothing waits for the GPU."""
    n_local, cap, hidden = x.shape
    _check_out(x, out)
    if counts.numel() != n_local:
        raise ValueError(f"{counts.numel()} counts for {n_local} experts' slabs")
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    est = max(1.0, cap / 4 if rows_per_expert is None else min(float(rows_per_expert), cap))
    order, offsets = batched_order(counts, cap)
    _experts(x.view(n_local * cap, hidden), order, offsets, w1, w2, out.view(n_local * cap, hidden),
             est, configs, persistent, sm_carveout)
    return out


def segmented_swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                             caps: Sequence[int], *, out: torch.Tensor,
                             rows_per_expert: float | None = None, configs=None,
                             persistent: bool | None = None, sm_carveout: int | None = None) -> torch.Tensor:
    """SwiGLU experts once over several ubatches' slabs laid end to end in ``x`` ``[R, hidden]``,
    ``R = L * sum(caps)``: region ``u`` (rows ``base_u .. base_u + L * caps[u]``,
    :func:`segment_bases`) is ubatch ``u``'s ``[L, caps[u], hidden]`` slab, expert ``e``'s rows
    the first ``counts[e, u]`` (``counts`` ``[L, U]`` int on the device) of its part. Writes
    each of those rows' output to the same row of ``out`` ``[R, hidden]`` (other rows left
    unwritten), so ``out``'s region ``u`` viewed as ``[L, caps[u], hidden]`` is ubatch ``u``'s
    output slab. CUDA, Triton; the other arguments as for :func:`batched_swiglu_experts`
    (``rows_per_expert`` over all segments, default a quarter of ``sum(caps)``). Returns
    ``out``; nothing waits for the GPU."""
    n_local, hidden = w2.shape[0], w2.shape[1]
    caps = tuple(int(c) for c in caps)
    n_rows = segment_bases(n_local, caps)[-1]
    if x.dim() != 2 or x.shape != (n_rows, hidden):
        raise ValueError(f"x must be [L * sum(caps), hidden] = {(n_rows, hidden)}, got {tuple(x.shape)}")
    _check_out(x, out)
    if counts.shape != (n_local, len(caps)):
        raise ValueError(f"counts must be [L, U] = {(n_local, len(caps))}, got {tuple(counts.shape)}")
    if n_rows == 0:
        return out
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    total = sum(caps)
    est = max(1.0, total / 4 if rows_per_expert is None else min(float(rows_per_expert), total))
    order, offsets = batched_order(counts, caps)
    _experts(x, order, offsets, w1, w2, out, est, configs, persistent, sm_carveout)
    return out
