"""Fused SwiGLU experts for CUDA (Triton): three kernels between the routing and the output.

``out[m] = sum over local slots s of w[m, s] * (silu(x[m] @ g_e.T) * (x[m] @ u_e.T)) @ d_e.T``
with ``e = topk_ids[m, s]``, ``[g_e; u_e] = w1[e]`` and ``d_e = w2[e]``.

1. The (token, slot) pairs are sorted by local expert on the device: up to ``ROUTE_MAX_PAIRS``
   a counting sort in two Triton launches (a histogram per chunk, then each pair's place),
   above it one 16-bit radix sort and a ``searchsorted`` for each expert's end row. Nothing is
   read back.
2. ``gate_up``: a grouped GEMM whose prologue gathers each row's token from ``x`` (no gathered
   copy of the activations) and whose epilogue applies ``silu(gate) * up`` (no ``[R, 2I]``
   intermediate): it computes the gate and up tiles of the same columns side by side.
3. ``down``: a grouped GEMM whose epilogue writes each row to its slot's place, ``y[m * topk +
   s]`` (``[M * topk, hidden]``, slots of other ranks' experts left unwritten).
4. ``topk_sum``: ``out[m] = sum_s w[m, s] * y[m * topk + s]`` over the local slots, float32
   accumulation, contiguous reads, no atomics (the sum's order is fixed: run to run the same).

A program finds its expert and its tile from the device offsets itself (a scan over at most
``BLOCK_E`` experts), so the grid is an upper bound known on the host: programs past the last
expert's tiles return at once. Within an expert the tiles are visited in groups of ``group_m``
row blocks per column block, so that concurrent programs share weight tiles in L2.

Both GEMMs' tiles are ``BLOCK_M`` rows of one expert; an expert's last tile, when its rows fit,
runs as a smaller tile (``GemmConfig.tail_m``, or half of ``BLOCK_M``), so the rows past the
expert's end cost no flops (at 128 rows per expert a 128-row tile computed 1.5x the rows).
Tile sizes come from :mod:`dbo.moe.fused_tiles` (per bucket of rows per expert, intermediate
size and local experts, measured on an H200: see docs/perf_notes.md); ``configs=`` overrides.
"""

from __future__ import annotations

import torch

from dbo.moe.fused_route import route_order
from dbo.moe.fused_tiles import (
    CONFIGS,
    FP32_CONFIG,
    FUSED_MAX_ROWS_PER_EXPERT,
    GemmConfig,
    pick_configs,
    prefer_fused,
)
from dbo.moe.gather_reduce import _block

__all__ = ["GemmConfig", "CONFIGS", "FP32_CONFIG", "FUSED_MAX_ROWS_PER_EXPERT", "prefer_fused",
           "pick_configs", "fused_swiglu_experts", "route_order", "launch_gate_up", "launch_down"]

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:

    @triton.jit
    def _tile_of(pid, offs_ptr, n_experts, n_col_blocks, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
        # -> (expert, the tile's first row, the expert's end row, column block); expert ==
        # n_experts: the program has no tile
        es = tl.arange(0, BLOCK_E)
        live = es < n_experts
        ends = tl.load(offs_ptr + es, mask=live, other=0)
        starts = tl.load(offs_ptr + es - 1, mask=live & (es > 0), other=0)
        m_tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = tl.cumsum(m_tiles, 0) * n_col_blocks
        e = tl.sum((tl.where(live, tile_ends, 2147483647) <= pid).to(tl.int32), 0)
        sel = es == e
        first_tile = tl.sum(tl.where(sel, tile_ends - m_tiles * n_col_blocks, 0), 0)
        first_row = tl.sum(tl.where(sel, starts, 0), 0)
        end_row = tl.sum(tl.where(sel, ends, 0), 0)
        num_m = tl.sum(tl.where(sel, m_tiles, 0), 0)
        local = pid - first_tile
        group = GROUP_M * n_col_blocks
        first_m = (local // group) * GROUP_M
        size_m = tl.maximum(tl.minimum(num_m - first_m, GROUP_M), 1)
        pid_m = first_m + (local % group) % size_m
        pid_n = (local % group) // size_m
        return e, first_row + pid_m * BLOCK_M, end_row, pid_n

    @triton.jit
    def _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter, stride_we,
                      TOPK: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                      TMA: tl.constexpr):
        # BM rows from row0 (those below end_row are the expert's) x BLOCK_N columns of gate and up
        rows = row0 + tl.arange(0, BM)
        row_mask = rows < end_row
        tokens = (tl.load(order_ptr + rows, mask=row_mask, other=0) // TOPK).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * hidden + ks[None, :]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        acc_g = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
        if TMA:  # w: w1 as [E * 2I, hidden], box [BLOCK_N, BLOCK_K]; hidden % BLOCK_K == 0
            g_row = e * 2 * inter + pid_n * BLOCK_N
            for k0 in range(0, hidden, BLOCK_K):
                a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                g = w.load([g_row, k0])
                u = w.load([g_row + inter, k0])
                acc_g = tl.dot(a, g.T, acc_g)
                acc_u = tl.dot(a, u.T, acc_u)
                a_ptrs += BLOCK_K
        else:
            g_ptrs = w + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * hidden + ks[:, None]
            u_ptrs = g_ptrs + inter * hidden
            for k0 in range(0, hidden, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                    g = tl.load(g_ptrs, mask=col_mask[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=col_mask[None, :], other=0.0)
                else:
                    k_mask = (k0 + ks) < hidden
                    a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    g = tl.load(g_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
                    u = tl.load(u_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
                acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _gate_up_kernel(x_ptr, order_ptr, offs_ptr, w, act_ptr, n_experts, hidden, inter, stride_we,
                        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
                        TAIL_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        TMA: tl.constexpr):
        # an expert's last tile, when its rows fit, runs as a TAIL_M-row (or BLOCK_M // 2-row)
        # tile: the flops of the rows past the expert's end are not spent
        e, row0, end_row, pid_n = _tile_of(tl.program_id(0), offs_ptr, n_experts,
                                           tl.cdiv(inter, BLOCK_N), BLOCK_M, BLOCK_E, GROUP_M)
        if e >= n_experts:
            return
        n = end_row - row0
        if TAIL_M == 0:
            _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                          stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
        elif TAIL_M * 2 < BLOCK_M:
            if n <= TAIL_M:
                _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                              stride_we, TOPK, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
            elif n <= BLOCK_M // 2:
                _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                              stride_we, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
            else:
                _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                              stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
        else:
            if n <= TAIL_M:
                _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                              stride_we, TOPK, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
            else:
                _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                              stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)

    @triton.jit
    def _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                   stride_we, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                   A_DESC: tl.constexpr):
        # y[order[r]] = act[r] @ d_e.T for BM rows from row0 x BLOCK_N columns
        rows = row0 + tl.arange(0, BM)
        row_mask = rows < end_row
        rows64 = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + rows64[:, None] * inter + ks[None, :]
        acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
        if TMA:  # w: w2 as [E * hidden, inter], box [BLOCK_N, BLOCK_K]; inter % BLOCK_K == 0
            w_row = e * hidden + pid_n * BLOCK_N
            for k0 in range(0, inter, BLOCK_K):
                if A_DESC:  # act as [R, inter], box [BM, BLOCK_K]: rows past the expert's end
                    # belong to the next expert: computed, never stored
                    a = act_desc.load([row0, k0])
                else:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                b = w.load([w_row, k0])
                acc = tl.dot(a, b.T, acc)
                a_ptrs += BLOCK_K
        else:
            b_ptrs = w + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * inter + ks[:, None]
            for k0 in range(0, inter, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=col_mask[None, :], other=0.0)
                else:
                    k_mask = (k0 + ks) < inter
                    a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _down_kernel(act_ptr, act_desc, order_ptr, offs_ptr, w, y_ptr, n_experts, hidden, inter,
                     stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TAIL_M: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
        # the tails as in _gate_up_kernel; act_desc (TMA: a [BLOCK_M, BLOCK_K] box) serves the
        # full tiles, the tails read act through pointers
        e, row0, end_row, pid_n = _tile_of(tl.program_id(0), offs_ptr, n_experts,
                                           tl.cdiv(hidden, BLOCK_N), BLOCK_M, BLOCK_E, GROUP_M)
        if e >= n_experts:
            return
        n = end_row - row0
        if TAIL_M == 0:
            _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                       stride_we, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, TMA)
        elif TAIL_M * 2 < BLOCK_M:
            if n <= TAIL_M:
                _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden,
                           inter, stride_we, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, False)
            elif n <= BLOCK_M // 2:
                _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden,
                           inter, stride_we, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, False)
            else:
                _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden,
                           inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, TMA)
        else:
            if n <= TAIL_M:
                _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden,
                           inter, stride_we, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, False)
            else:
                _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden,
                           inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, TMA)

    @triton.jit
    def _down_short_k_kernel(act_ptr, order_ptr, offs_ptr, w_ptr, y_ptr, n_experts, hidden, inter,
                             stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, N_PER_PROGRAM: tl.constexpr, BLOCK_E: tl.constexpr,
                             GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
        # inter <= BLOCK_K: a program loads its rows' activations once and walks N_PER_PROGRAM
        # column blocks; the loop over columns is the one Triton pipelines (the next weight tile
        # loads while this one multiplies), where a K loop of a few steps would not pipeline
        n_col_groups = tl.cdiv(tl.cdiv(hidden, BLOCK_N), N_PER_PROGRAM)
        e, row0, end_row, pid_g = _tile_of(tl.program_id(0), offs_ptr, n_experts, n_col_groups,
                                           BLOCK_M, BLOCK_E, GROUP_M)
        if e >= n_experts:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < inter
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * inter + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        for nb in tl.range(0, N_PER_PROGRAM):
            cols = (pid_g * N_PER_PROGRAM + nb) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < hidden
            b = tl.load(w_base + cols[None, :].to(tl.int64) * inter + ks[:, None],
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, input_precision=PRECISION)
            tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _topk_sum_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, n_experts, hidden, TOPK: tl.constexpr,
                         BLOCK: tl.constexpr):
        # a slot of another rank's expert reads nothing: its row of y was never written
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            e = tl.load(ids_ptr + m * TOPK + s)
            if (e >= 0) & (e < n_experts):
                w = tl.load(w_ptr + m * TOPK + s).to(tl.float32)
                acc += w * tl.load(y_ptr + (m * TOPK + s) * hidden + cols, mask=mask,
                                   other=0.0).to(tl.float32)
        tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_e(n_experts: int) -> int:
    return max(16, triton.next_power_of_2(n_experts))


def _grid(cfg: GemmConfig, pairs: int, n_experts: int, cols: int) -> tuple[int]:
    # sum over experts of ceil(rows_e / BLOCK_M) <= pairs / BLOCK_M + E
    return ((triton.cdiv(pairs, cfg.block_m) + n_experts) * triton.cdiv(cols, cfg.block_n),)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def launch_gate_up(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                   act: torch.Tensor, cfg: GemmConfig, pairs: int, topk: int) -> None:
    """``act[r] = silu(x[t] @ g_e.T) * (x[t] @ u_e.T)`` for each sorted row ``r`` of expert
    ``e`` (``t = order[r] // topk``); ``pairs``: an upper bound of the local pairs (the grid)."""
    n_experts, two_inter, hidden = w1.shape
    inter = two_inter // 2
    cfg = FP32_CONFIG if x.element_size() > 2 else cfg
    tma = cfg.tma and hidden % cfg.block_k == 0
    w = TensorDescriptor.from_tensor(w1.view(n_experts * two_inter, hidden), [cfg.block_n, cfg.block_k]) \
        if tma else w1
    _gate_up_kernel[_grid(cfg, pairs, n_experts, inter)](
        x, order, offsets, w, act, n_experts, hidden, inter, w1.stride(0), TOPK=topk,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=_block_e(n_experts),
        GROUP_M=cfg.group_m, TAIL_M=cfg.tail_m, EVEN_K=hidden % cfg.block_k == 0,
        PRECISION=_precision(x), TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_down(act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w2: torch.Tensor,
                y: torch.Tensor, cfg: GemmConfig, pairs: int) -> None:
    """``y[order[r]] = act[r] @ d_e.T`` for each sorted row ``r`` of expert ``e``."""
    n_experts, hidden, inter = w2.shape
    cfg = FP32_CONFIG if act.element_size() > 2 else cfg
    if cfg.n_per_program:
        if triton.next_power_of_2(inter) > cfg.block_k:
            raise ValueError(f"a short-K tile needs block_k >= intermediate ({inter}), got {cfg.block_k}")
        groups = triton.cdiv(triton.cdiv(hidden, cfg.block_n), cfg.n_per_program)
        _down_short_k_kernel[((triton.cdiv(pairs, cfg.block_m) + n_experts) * groups,)](
            act, order, offsets, w2, y, n_experts, hidden, inter, w2.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            N_PER_PROGRAM=cfg.n_per_program, BLOCK_E=_block_e(n_experts), GROUP_M=cfg.group_m,
            PRECISION=_precision(act), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    tma = cfg.tma and inter % cfg.block_k == 0
    a_desc, w = act, w2
    if tma:
        a_desc = TensorDescriptor.from_tensor(act, [cfg.block_m, cfg.block_k])
        w = TensorDescriptor.from_tensor(w2.view(n_experts * hidden, inter), [cfg.block_n, cfg.block_k])
    _down_kernel[_grid(cfg, pairs, n_experts, hidden)](
        act, a_desc, order, offsets, w, y, n_experts, hidden, inter, w2.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=_block_e(n_experts),
        GROUP_M=cfg.group_m, TAIL_M=cfg.tail_m, EVEN_K=inter % cfg.block_k == 0,
        PRECISION=_precision(act), TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         out: torch.Tensor, reduce: bool = True, max_local_pairs: int | None = None,
                         configs: tuple[GemmConfig, GemmConfig] | None = None,
                         bounds: torch.Tensor | None = None,
                         rows_per_expert: float | None = None) -> torch.Tensor:
    """Routed SwiGLU experts, fused (see the module docstring). CUDA tensors, Triton.

    Args:
        x: ``[M, hidden]`` bf16/fp16/float32 tokens.
        w1: ``[E, 2I, hidden]`` gate rows first, ``x``'s dtype. w2: ``[E, hidden, I]``.
        topk_weights: ``[M, topk]`` float (router weights; ones for weights applied on input).
        topk_ids: ``[M, topk]`` int32/int64 local expert ids, ``-1`` for other ranks' experts.
        out: ``[M, hidden]`` (``reduce``) or ``[M, topk, hidden]`` (not ``reduce``: each slot's
            unweighted output, zeros for other ranks' slots), ``x``'s dtype.
        max_local_pairs: an upper bound of the local pairs if the host knows one (DeepEP's host
            counts): it sizes the grid and picks the tiles; default ``M * topk``.
        configs: ``(gate_up, down)`` tiles; default :func:`pick_configs`.
        bounds: cached ``arange(1, E + 1)`` int16 on the device (see :func:`route_order`).
        rows_per_expert: the caller's estimate, for the tiles (default ``max_local_pairs / E``).

    Returns:
        ``out``. Nothing waits for the GPU.
    """
    m, hidden = x.shape
    n_experts, two_inter, _ = w1.shape
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    order, offsets = route_order(topk_ids, n_experts, bounds)
    pairs = m * topk if max_local_pairs is None else min(max_local_pairs, m * topk)
    if configs is None:
        configs = pick_configs(pairs / n_experts if rows_per_expert is None else rows_per_expert, inter,
                               n_experts)
    up_cfg, down_cfg = configs
    act = torch.empty(m * topk, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x, order, offsets, w1, act, up_cfg, pairs, topk)
    y = out.view(m * topk, hidden) if not reduce else \
        torch.empty(m * topk, hidden, dtype=x.dtype, device=x.device)
    launch_down(act, order, offsets, w2, y, down_cfg, pairs)
    if not reduce:
        local = (topk_ids >= 0) & (topk_ids < n_experts)
        return out.masked_fill_(~local.unsqueeze(-1), 0)
    block = _block(hidden)
    _topk_sum_kernel[(m, triton.cdiv(hidden, block))](
        y, topk_ids.contiguous(), topk_weights.contiguous(), out, n_experts, hidden, TOPK=topk,
        BLOCK=block)
    return out
