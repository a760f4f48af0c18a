"""Grouped GEMM over rows sorted by expert, with per-expert end rows that live on the device.

``out[r] = a[r] @ w[e].T`` for the rows ``r`` of expert ``e`` (``offsets[e-1] <= r <
offsets[e]``). Which kernel runs:

* CUDA, bf16, Hopper or newer, sizes multiple of 8: ``torch._grouped_mm`` (CUTLASS; it reads the
  offsets on the device);
* other CUDA cases with Triton importable: a Triton grouped GEMM that reads the offsets on the
  device too (a tile of ``BLOCK_M`` rows per program; the grid is the most tiles the rows can
  need, the programs past the last expert's tiles do nothing). float32 is computed in IEEE
  float32, not TF32;
* otherwise a loop over the experts on their host-side counts (given, or read from
  ``offsets``: on CUDA that read waits for the GPU; on the CPU it costs nothing).

Rows past ``offsets[-1]`` are left unwritten by every kernel.
"""

from __future__ import annotations

import torch

from dbo.kernels.triton_launch import use_triton_for

__all__ = ["grouped_mm", "grouped_mm_kernel"]

_torch_grouped_mm = getattr(torch, "_grouped_mm", None)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, tile_ends_ptr, n_experts, n_cols, k_dim,
                             stride_be, stride_bn, stride_bk, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                             PRECISION: tl.constexpr):
        t = tl.program_id(0)
        es = tl.arange(0, BLOCK_E)
        ends = tl.load(tile_ends_ptr + es, mask=es < n_experts, other=2147483647)
        e = tl.sum((ends <= t).to(tl.int32), axis=0)  # the expert whose tiles hold tile t
        live = e < n_experts
        e = tl.minimum(e, n_experts - 1)
        first_tile = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)
        first_row = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end_row = tl.where(live, tl.load(offs_ptr + e), 0)  # a program past the last tile: no rows
        rows = first_row + (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_base = b_ptr + e.to(tl.int64) * stride_be
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_dim
            a = tl.load(a_ptr + rows64[:, None] * k_dim + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def _triton_grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    rows, k_dim = a.shape
    n_experts, n_cols, _ = w.shape
    out = torch.empty(rows, n_cols, dtype=a.dtype, device=a.device)
    block_m, block_n, block_k = 64, 64, 32
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    tile_ends = torch.cumsum((counts + block_m - 1) // block_m, 0).to(torch.int32)
    # sum over experts of ceil(count / BLOCK_M) <= rows / BLOCK_M + experts
    grid = (triton.cdiv(rows, block_m) + n_experts, triton.cdiv(n_cols, block_n))
    _grouped_gemm_kernel[grid](
        a.contiguous(), w, out, offsets, tile_ends, n_experts, n_cols, k_dim,
        w.stride(0), w.stride(1), w.stride(2), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(16, triton.next_power_of_2(n_experts)),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
    return out


def _loop_grouped_mm(a: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a[start:start + c], w[e].t(), out=out[start:start + c])
        start += c
    return out


def grouped_mm_kernel(a: torch.Tensor, w: torch.Tensor, *, use_grouped_mm: bool | None = None,
                      use_triton: bool | None = None) -> str:
    """Which kernel :func:`grouped_mm` runs for ``a``/``w``: ``"torch"`` (``torch._grouped_mm``),
    ``"triton"`` or ``"loop"``."""
    cutlass = (a.is_cuda and a.dtype == torch.bfloat16 and _torch_grouped_mm is not None
               and a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0
               and torch.cuda.get_device_capability(a.device)[0] >= 9)
    if cutlass and use_grouped_mm is not False:
        return "torch"
    if use_triton_for(a, use_triton):  # forced on CPU tensors: TRITON_INTERPRET=1 tests
        return "triton"
    return "loop"


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               host_counts: tuple[int, ...] | None = None, *, use_grouped_mm: bool | None = None,
               use_triton: bool | None = None) -> torch.Tensor:
    """``out[r] = a[r] @ w[e].T`` over rows grouped by expert.

    Args:
        a: ``[R, K]`` rows sorted by expert.
        w: ``[E, N, K]`` one weight matrix per expert, ``a``'s dtype.
        offsets: ``[E]`` int32 on ``a``'s device, the end row of each expert.
        host_counts: the rows per expert on the host, if known (the loop uses them instead of
            reading ``offsets``).
        use_grouped_mm / use_triton: force a kernel on or off (default: the best available).

    Returns:
        ``[R, N]`` in ``a``'s dtype; rows past ``offsets[-1]`` unspecified.
    """
    if a.shape[0] == 0:
        return torch.empty(0, w.shape[1], dtype=a.dtype, device=a.device)
    kind = grouped_mm_kernel(a, w, use_grouped_mm=use_grouped_mm, use_triton=use_triton)
    if kind == "torch":
        return _torch_grouped_mm(a, w.transpose(1, 2), offs=offsets)
    if kind == "triton":
        return _triton_grouped_mm(a, w, offsets)
    if host_counts is None:
        ends = offsets.tolist()
        host_counts = tuple(b - a_ for a_, b in zip([0, *ends[:-1]], ends, strict=True))
    return _loop_grouped_mm(a, w, host_counts)
