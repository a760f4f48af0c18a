"""The elementwise and reduction kernels around the experts' grouped GEMMs.

* :func:`silu_and_mul`: the SwiGLU activation ``silu(gate) * up`` of ``[R, 2I]`` rows in one
  pass, skipping the rows past the number of local pairs (read on the device).
* :func:`gather_rows`: the tokens' rows in expert order, skipping those padding rows too.
* :func:`gather_reduce`: each token's output row is the router-weighted sum of its slots' expert
  output rows. One Triton program per output row reads only its own slots' rows and accumulates
  in float32: no atomics and no ``[M, topk, hidden]`` intermediate. (It replaced a bf16
  ``index_add_`` whose atomics took about a third of a layer's compute on an H200.)

Triton is optional: the kernels are used on CUDA tensors when ``triton`` is importable; a plain
torch version, correct on every device, is used otherwise (``use_triton=False`` forces it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dbo.kernels.triton_launch import HAVE_TRITON, use_triton_for

__all__ = ["silu_and_mul", "gather_rows", "gather_reduce", "row_block"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch versions are used
    triton = None

if HAVE_TRITON:

    @triton.jit
    def _row_limit(valid_ptr, n_rows, HAS_VALID: tl.constexpr):
        # rows past the local pairs (read on the device) are padding: never computed
        limit = n_rows
        if HAS_VALID:
            limit = tl.minimum(tl.load(valid_ptr).to(tl.int64), n_rows)
        return limit

    @triton.jit
    def _silu_mul_kernel(h_ptr, out_ptr, valid_ptr, n_rows, inter, HAS_VALID: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        limit = _row_limit(valid_ptr, n_rows, HAS_VALID)
        mask = (rows < limit)[:, None] & (cols < inter)[None, :]
        src = h_ptr + rows[:, None] * 2 * inter + cols[None, :]
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * inter + cols[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _gather_rows_kernel(x_ptr, idx_ptr, out_ptr, valid_ptr, n_rows, hidden,
                            HAS_VALID: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = rows < _row_limit(valid_ptr, n_rows, HAS_VALID)
        src = tl.load(idx_ptr + rows, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & (cols < hidden)[None, :]
        vals = tl.load(x_ptr + src[:, None] * hidden + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], vals, mask=mask)

    @triton.jit
    def _gather_reduce_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, hidden,
                              TOPK: tl.constexpr, BLOCK: tl.constexpr):
        # a slot with weight 0 (routed to another rank) reads nothing: its row may be garbage
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            w = tl.load(w_ptr + m * TOPK + s)
            if w != 0.0:
                row = tl.load(rows_ptr + m * TOPK + s).to(tl.int64)
                acc += w * tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def row_block(n: int, cap: int = 1024) -> int:
    """Columns of one program's share of a row of ``n`` elements: the row's power of two (at
    least 16), at most ``cap`` (the row-wise kernels here and the top-k sum of
    :mod:`dbo.experts.kernels.fused_experts`)."""
    return cap if n >= cap else max(16, triton.next_power_of_2(n))


def _tile(n: int) -> tuple[int, int]:
    """Columns and rows of one program's tile: about 4096 elements."""
    block = row_block(n)
    return block, max(1, 4096 // block)


def silu_and_mul(h: torch.Tensor, num_valid: torch.Tensor | None = None, *,
                 use_triton: bool | None = None) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]``.

    Args:
        h: ``[R, 2I]`` contiguous, gate columns first.
        num_valid: optional ``[1]`` integer tensor on ``h``'s device: only rows below it are
            computed by the Triton kernel (the rest are left unwritten); the torch version
            computes every row.
        use_triton: see :func:`use_triton_for`.

    Returns:
        ``[R, I]`` in ``h``'s dtype.
    """
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [rows, 2 * intermediate], got shape {tuple(h.shape)}")
    rows, inter = h.shape[0], h.shape[1] // 2
    if not use_triton_for(h, use_triton) or rows == 0:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    h = h.contiguous()
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    block, per = _tile(inter)
    valid = h if num_valid is None else num_valid  # any pointer when unused
    _silu_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(inter, block))](
        h, out, valid, rows, inter, HAS_VALID=num_valid is not None, ROWS=per, BLOCK=block)
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor, num_valid: torch.Tensor | None = None, *,
                use_triton: bool | None = None) -> torch.Tensor:
    """``x[index]``: ``x`` ``[M, hidden]``, ``index`` ``[R]`` int64 in ``[0, M)``.

    ``num_valid``: optional ``[1]`` integer tensor on the device; the Triton kernel copies only
    the rows below it (the rest are left unwritten); the torch version copies every row.
    Returns ``[R, hidden]`` in ``x``'s dtype.
    """
    if not use_triton_for(x, use_triton) or index.numel() == 0 or num_valid is None:
        return x.index_select(0, index)
    rows, hidden = index.numel(), x.shape[1]
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    block, per = _tile(hidden)
    _gather_rows_kernel[(triton.cdiv(rows, per), triton.cdiv(hidden, block))](
        x.contiguous(), index.contiguous(), out, num_valid, rows, hidden, HAS_VALID=True,
        ROWS=per, BLOCK=block)
    return out


def gather_reduce(y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor,
                  local: torch.Tensor, *, out: torch.Tensor | None = None,
                  use_triton: bool | None = None) -> torch.Tensor:
    """``out[m] = sum over local slots s of weights[m, s] * y[slot_rows[m, s]]``.

    Args:
        y: ``[R, hidden]`` expert outputs (rows of non-local slots may hold garbage: they are
            never read).
        slot_rows: ``[M, topk]`` int64 row of ``y`` of each slot, in ``[0, R)``.
        weights: ``[M, topk]`` float32 router weights.
        local: ``[M, topk]`` bool, which slots to sum.
        out: optional ``[M, hidden]`` destination in ``y``'s dtype.
        use_triton: see :func:`use_triton_for`.

    Returns:
        ``[M, hidden]`` in ``y``'s dtype, accumulated in float32.
    """
    m, topk = slot_rows.shape
    hidden = y.shape[1]
    if out is None:
        out = torch.empty(m, hidden, dtype=y.dtype, device=y.device)
    if m == 0:
        return out
    w = torch.where(local, weights.to(torch.float32), 0.0)
    if use_triton_for(y, use_triton):
        block = row_block(hidden)
        _gather_reduce_kernel[(m, triton.cdiv(hidden, block))](
            y.contiguous(), slot_rows.contiguous(), w.contiguous(), out, hidden, TOPK=topk, BLOCK=block)
        return out
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=y.device)
    for s in range(topk):  # one slot at a time: memory stays [M, hidden]
        rows = y.index_select(0, slot_rows[:, s]).to(torch.float32)
        # where, not a product: a garbage row may hold inf/NaN, and 0 * NaN is NaN
        acc += torch.where(local[:, s, None], rows * w[:, s, None], 0.0)
    out.copy_(acc)
    return out
