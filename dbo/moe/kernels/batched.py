"""The BATCHED_EXPERTS layout (DeepEP low-latency's ``[L, cap, hidden]`` slabs) on the fused
experts' kernels: work for the rows that arrived, not for each expert's capacity.

In that layout expert ``e``'s rows are the first ``counts[e]`` of its slab ``x[e]``, counted on
the device only (reading them back would stall the host, and a CUDA graph cannot). Two batched
matmuls over the whole slab do ``cap / counts[e]`` times the work: on 4 ranks with 128 tokens
per rank the slab holds 512 rows per expert where about 128 arrive. Here the rows are sorted by
expert already, so one launch (:func:`batched_order`) writes each sorted row's place in the
slab and each expert's end row, the ``(order, offsets)`` pair of
:func:`dbo.moe.kernels.fused_route.route_order`, and the fused gate/up and down GEMMs of
:mod:`dbo.moe.kernels.fused_experts` run on it: their grid is bounded by the capacity, their
programs past the last expert's rows return at once, and the down GEMM writes each row back to
its slab place (rows past an expert's count are left unwritten, as the layout allows).

:func:`move_rows` is the copy the merged schedule needs for this layout (:mod:`dbo.moe.merged`):
``dst[dst_rows[i]] = src[src_rows[i]]`` for the pairs whose indices are both ``>= 0``, so that
only the rows that arrived are copied, not the slabs.
"""

from __future__ import annotations

import torch

from dbo.moe.kernels.fused_experts import launch_down, launch_gate_up, pick_configs
from dbo.moe.kernels.fused_maps import block_e
from dbo.moe.kernels.gather_reduce import use_triton_for
from dbo.moe.kernels.triton_launch import cdiv, launch

__all__ = ["batched_order", "batched_swiglu_experts", "move_rows", "MOVE_ROWS_PER_PROGRAM"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None

#: rows copied per program of :func:`move_rows` (the rows are short: a decode layer's slabs
#: hold a few thousand)
MOVE_ROWS_PER_PROGRAM = 4

if triton is not None:

    @triton.jit
    def _batched_order_kernel(counts_ptr, order_ptr, offsets_ptr, n_experts, cap, n_rows,
                              BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
        # sorted row r of expert e (ends[e - 1] <= r < ends[e]) is slab row e * cap + r - start_e
        pid = tl.program_id(0)
        ex = tl.arange(0, BLOCK_E)
        live = ex < n_experts
        counts = tl.minimum(tl.load(counts_ptr + ex, mask=live, other=0).to(tl.int32), cap)
        ends = tl.cumsum(counts, 0)
        if pid == 0:
            tl.store(offsets_ptr + ex, ends, mask=live)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        past = tl.where(live[None, :], ends[None, :] <= r[:, None], False)
        e = tl.minimum(tl.sum(past.to(tl.int32), 1), n_experts - 1)
        own = ex[None, :] == e[:, None]
        start = tl.sum(tl.where(own, (ends - counts)[None, :], 0), 1)
        tl.store(order_ptr + r, e * cap + r - start, mask=r < n_rows)

    @triton.jit
    def _move_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n, width,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        for i in tl.static_range(ROWS):
            j = pid * ROWS + i
            if j < n:
                s = tl.load(src_rows_ptr + j).to(tl.int64)
                d = tl.load(dst_rows_ptr + j).to(tl.int64)
                if (s >= 0) & (d >= 0):
                    for c0 in range(0, width, BLOCK):
                        c = c0 + tl.arange(0, BLOCK)
                        keep = c < width
                        v = tl.load(src_ptr + s * width + c, mask=keep)
                        tl.store(dst_ptr + d * width + c, v, mask=keep)


def batched_order(counts: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offsets)`` for slabs of ``cap`` rows whose expert ``e`` holds ``counts[e]``
    (``[L]`` int, on the device; clamped to ``cap``): ``order`` int32 ``[L * cap]``, sorted row
    ``r`` of expert ``e`` -> its slab row ``e * cap + j`` (past ``offsets[-1]`` unspecified);
    ``offsets`` int32 ``[L]``, each expert's end row. One launch, no host sync."""
    n_experts = counts.numel()
    if n_experts == 0 or cap < 1:
        raise ValueError(f"need at least one expert and cap >= 1, got {n_experts} and {cap}")
    if n_experts * cap >= 2**31:
        raise ValueError(f"{n_experts} slabs of {cap} rows overflow int32 row indices")
    n_rows = n_experts * cap
    order = torch.empty(n_rows, dtype=torch.int32, device=counts.device)
    offsets = torch.empty(n_experts, dtype=torch.int32, device=counts.device)
    block_r = 128
    launch(_batched_order_kernel, (cdiv(n_rows, block_r),), (
        counts.contiguous(), order, offsets, n_experts, cap, n_rows), dict(
        BLOCK_E=block_e(n_experts), BLOCK_R=block_r, num_warps=4))
    return order, offsets


def batched_swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, *,
                           out: torch.Tensor, rows_per_expert: float | None = None,
                           configs=None, persistent: bool | None = None,
                           sm_carveout: int | None = None) -> torch.Tensor:
    """SwiGLU experts on ``x`` ``[L, cap, hidden]`` (expert ``e``'s rows the first ``counts[e]``
    of ``x[e]``) into ``out`` (same shape; rows past the counts left unwritten). CUDA, Triton.

    ``rows_per_expert``: the caller's estimate of the rows that arrive per expert, for the tiles
    (default a quarter of ``cap``); ``configs``/``persistent``/``sm_carveout`` as for
    :func:`dbo.moe.kernels.fused_experts.fused_swiglu_experts` (default persistent: the grid's
    bound is the capacity, most of it empty). Returns ``out``; nothing waits for the GPU."""
    n_local, cap, hidden = x.shape
    inter = w2.shape[2]
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if counts.numel() != n_local:
        raise ValueError(f"{counts.numel()} counts for {n_local} experts' slabs")
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    est = max(1.0, cap / 4 if rows_per_expert is None else min(float(rows_per_expert), cap))
    up_cfg, down_cfg = pick_configs(est, inter, n_local) if configs is None else configs
    persistent = True if persistent is None else persistent
    order, offsets = batched_order(counts, cap)
    pairs = n_local * cap
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x.view(pairs, hidden), order, offsets, w1, act, up_cfg, pairs, 1, persistent,
                   sm_carveout=sm_carveout)
    launch_down(act, order, offsets, w2, out.view(pairs, hidden), down_cfg, pairs, persistent,
                sm_carveout=sm_carveout)
    return out


def move_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              *, row_dims: int = 1, use_triton: bool | None = None) -> torch.Tensor:
    """``dst.view(-1, width)[dst_rows[i]] = src.view(-1, width)[src_rows[i]]`` for each ``i``
    where both are ``>= 0``, the rows being the first ``row_dims`` dims flattened (``width``:
    the elements past them); other rows of ``dst`` are left as they are. ``src_rows`` and
    ``dst_rows``: int ``[N]`` on the device. Triton on CUDA, one launch, no host sync; plain
    torch elsewhere (a boolean mask: it syncs). Returns ``dst``."""
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(f"src_rows and dst_rows must be equal 1-D, got {tuple(src_rows.shape)} "
                         f"and {tuple(dst_rows.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src is {src.dtype}, dst {dst.dtype}")
    if not 1 <= row_dims <= min(src.dim(), dst.dim()):
        raise ValueError(f"row_dims must be in 1..{min(src.dim(), dst.dim())}, got {row_dims}")
    width = 1
    for d in src.shape[row_dims:]:
        width *= d
    if tuple(dst.shape[row_dims:]) != tuple(src.shape[row_dims:]):
        raise ValueError(f"rows of {tuple(src.shape[row_dims:])} cannot go to rows of "
                         f"{tuple(dst.shape[row_dims:])}")
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")
    flat_src, flat_dst = src.reshape(-1, width).contiguous(), dst.view(-1, width)
    if flat_src.element_size() == 1 and flat_src.is_floating_point():  # fp8: move bytes
        flat_src, flat_dst = flat_src.view(torch.uint8), flat_dst.view(torch.uint8)
    n = src_rows.numel()
    if n == 0:
        return dst
    if not use_triton_for(src, use_triton):
        keep = (src_rows >= 0) & (dst_rows >= 0)
        flat_dst[dst_rows[keep].long()] = flat_src[src_rows[keep].long()]
        return dst
    block = min(1024, triton.next_power_of_2(width))
    launch(_move_rows_kernel, (cdiv(n, MOVE_ROWS_PER_PROGRAM),), (
        flat_src, flat_dst, src_rows.contiguous(), dst_rows.contiguous(), n, width), dict(
        ROWS=MOVE_ROWS_PER_PROGRAM, BLOCK=block, num_warps=4))
    return dst
