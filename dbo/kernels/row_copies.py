"""Row copies between activation buffers on the device, without a host sync: what the merged
expert schedule (:mod:`dbo.moe.merged`) and the DeepEP low-latency backend move, below both of
them and below the experts.

* :func:`copy_arrived_rows`: ``dst[e, :counts[e]] = src[e, :counts[e]]`` for BATCHED_EXPERTS
  slabs ``[L, cap, ...]`` (DeepEP low-latency's layout), the counts on the device only: only the
  rows that arrived are read, not the slabs;
* :func:`move_rows`: ``dst[dst_rows[i]] = src[src_rows[i]]`` for the pairs whose indices are
  both ``>= 0`` (the merged schedule's row copy for experts that take one slab).

Triton on CUDA tensors, one launch each; plain torch elsewhere
(:func:`dbo.kernels.triton_launch.use_triton_for`).
"""

from __future__ import annotations

import torch

from dbo.kernels.triton_launch import cdiv, launch, next_pow2, use_triton_for

__all__ = ["copy_arrived_rows", "move_rows", "MOVE_ROWS_PER_PROGRAM"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None

#: rows copied per program of :func:`move_rows` (the rows are short: a decode layer's slabs
#: hold a few thousand)
MOVE_ROWS_PER_PROGRAM = 4
#: rows of one program of :func:`copy_arrived_rows` (an expert's rows per ubatch at decode are
#: a few dozen: a program past an expert's count returns at once)
COPY_ROWS = 8

if triton is not None:

    @triton.jit
    def _copy_arrived_kernel(src_ptr, dst_ptr, counts_ptr, cap, width, stride_e, stride_j, stride_c,
                             row_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        e = pid // row_blocks
        j0 = (pid % row_blocks) * BLOCK_R
        count = tl.minimum(tl.load(counts_ptr + e).to(tl.int32), cap)
        if j0 < count:  # the slab rows past the count did not arrive: nothing to read
            j = j0 + tl.arange(0, BLOCK_R)
            c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            keep = (j < count)[:, None] & (c < width)[None, :]
            e64 = e.to(tl.int64)
            src = src_ptr + e64 * stride_e + j[:, None].to(tl.int64) * stride_j + c[None, :] * stride_c
            dst = dst_ptr + (e64 * cap + j[:, None]) * width + c[None, :]
            tl.store(dst, tl.load(src, mask=keep), mask=keep)

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


def copy_arrived_rows(src: torch.Tensor, dst: torch.Tensor, counts: torch.Tensor, *,
                      use_triton: bool | None = None) -> torch.Tensor:
    """``dst[e, :counts[e]] = src[e, :counts[e]]`` (each count clamped to the capacity) for the
    slabs ``src`` ``[L, cap, ...]`` (any strides) and ``dst`` of the same shape and dtype
    (contiguous); ``counts`` ``[L]`` int on the device. The rest of ``dst`` is left as it is,
    or on the plain torch path (``use_triton`` False; default: Triton on CUDA) overwritten with
    ``src`` (a whole-slab copy: no host sync either way). Triton: one launch, a program per
    expert, block of rows and block of columns, returning at once past the count. Returns ``dst``."""
    if src.shape != dst.shape or src.dtype != dst.dtype or src.dim() < 2:
        raise ValueError(f"src and dst must be [L, cap, ...] of one shape and dtype, got "
                         f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if counts.numel() != src.shape[0]:
        raise ValueError(f"{counts.numel()} counts for {src.shape[0]} experts' slabs")
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")
    if src.numel() == 0:
        return dst
    if not use_triton_for(src, use_triton):
        return dst.copy_(src)
    n_local, cap = src.shape[:2]
    rows = src.view(n_local, cap, 1) if src.dim() == 2 else src.flatten(2)
    flat_dst = dst.view(n_local, cap, -1)
    if rows.element_size() == 1 and rows.is_floating_point():  # fp8: move bytes
        rows, flat_dst = rows.view(torch.uint8), flat_dst.view(torch.uint8)
    width = rows.shape[2]
    block_c = min(next_pow2(width), max(16, 2048 // rows.element_size()))
    row_blocks = cdiv(cap, COPY_ROWS)
    launch(_copy_arrived_kernel, (n_local * row_blocks, cdiv(width, block_c)), (
        rows, flat_dst, counts, cap, width, rows.stride(0), rows.stride(1), rows.stride(2),
        row_blocks), dict(BLOCK_R=COPY_ROWS, BLOCK_C=block_c, num_warps=4))
    return dst


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
