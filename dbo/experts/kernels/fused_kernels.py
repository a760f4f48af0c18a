"""The fused experts' Triton kernels (:mod:`dbo.experts.kernels.fused_experts` launches them; its docstring
says what each computes): the tile table that each program reads from the device offsets, the
gate/up grouped GEMM with the row gather and SiLU*up fused, the down grouped GEMM (a K-loop tile
and a short-K tile for I <= 256) writing each row to its slot, and the top-k sum.

Each GEMM kernel takes a tile per program, or (``PERSISTENT``) walks every num_programs-th
tile; the one-tile path is straight-line code, since a loop around the tile, even of one trip,
cost 3-9% at 256 local experts on an H200 (more registers: 255 against 118-184).
"""

from __future__ import annotations

__all__ = ["gate_up_kernel", "down_kernel", "down_flat_kernel", "down_short_k_kernel", "topk_sum_kernel"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:
    from dbo.experts.kernels.fused_maps import map_tile

    @triton.jit
    def _tile_table(offs_ptr, n_experts, n_col_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        # per expert: its first and end rows, its row tiles, the end of its tiles in tile order;
        # and the number of tiles (each expert's row tiles times the column blocks)
        es = tl.arange(0, BLOCK_E)
        live = es < n_experts
        ends = tl.load(offs_ptr + es, mask=live, other=0)
        starts = tl.load(offs_ptr + es - 1, mask=live & (es > 0), other=0)
        m_tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = tl.where(live, tl.cumsum(m_tiles, 0) * n_col_blocks, 2147483647)
        return starts, ends, m_tiles, tile_ends, tl.sum(m_tiles, 0) * n_col_blocks

    @triton.jit
    def _grouped_tile(local, num_m, n_col_blocks, GROUP_M: tl.constexpr):
        # the local-th of num_m row blocks x n_col_blocks column blocks -> (row block, column
        # block): GROUP_M row blocks share a column block in tile order (the weight tile stays
        # in L2 while they read it)
        group = GROUP_M * n_col_blocks
        first_m = (local // group) * GROUP_M
        size_m = tl.maximum(tl.minimum(num_m - first_m, GROUP_M), 1)
        return first_m + (local % group) % size_m, (local % group) // size_m

    @triton.jit
    def _tile_at(t, starts, ends, m_tiles, tile_ends, n_col_blocks, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
        # tile t (< the table's tile count) -> (expert, its first row, the expert's end row,
        # column block); within an expert GROUP_M row blocks share a column block in tile order
        es = tl.arange(0, BLOCK_E)
        e = tl.sum((tile_ends <= t).to(tl.int32), 0)
        sel = es == e
        first_tile = tl.sum(tl.where(sel, tile_ends - m_tiles * n_col_blocks, 0), 0)
        first_row = tl.sum(tl.where(sel, starts, 0), 0)
        end_row = tl.sum(tl.where(sel, ends, 0), 0)
        num_m = tl.sum(tl.where(sel, m_tiles, 0), 0)
        pid_m, pid_n = _grouped_tile(t - first_tile, num_m, n_col_blocks, GROUP_M)
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
    def _gate_up_tile(t, starts, ends, m_tiles, tile_ends, x_ptr, order_ptr, w, act_ptr, hidden, inter,
                      stride_we, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
                      TAIL_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                      TMA: tl.constexpr):
        # tile t; an expert's last tile, when its rows fit, runs as a TAIL_M-row (or
        # BLOCK_M // 2-row) tile: the flops of the rows past the expert's end are not spent
        e, row0, end_row, pid_n = _tile_at(t, starts, ends, m_tiles, tile_ends, tl.cdiv(inter, BLOCK_N),
                                           BLOCK_M, BLOCK_E, GROUP_M)
        n = end_row - row0
        if TAIL_M == 0:
            _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                          stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
        elif n <= TAIL_M:
            _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                          stride_we, TOPK, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
        elif n <= BLOCK_M // 2:  # (never taken when TAIL_M is BLOCK_M // 2)
            _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                          stride_we, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
        else:
            _gate_up_rows(x_ptr, order_ptr, w, act_ptr, e, row0, end_row, pid_n, hidden, inter,
                          stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)

    @triton.jit
    def gate_up_kernel(x_ptr, order_ptr, offs_ptr, w, act_ptr, n_experts, hidden, inter, stride_we,
                        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
                        TAIL_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        TMA: tl.constexpr, PERSISTENT: tl.constexpr):
        # one tile per program (those past the tiles do nothing), or PERSISTENT: every
        # num_programs-th tile
        starts, ends, m_tiles, tile_ends, n_tiles = _tile_table(offs_ptr, n_experts, tl.cdiv(inter, BLOCK_N),
                                                                BLOCK_M, BLOCK_E)
        if PERSISTENT:
            for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _gate_up_tile(t, starts, ends, m_tiles, tile_ends, x_ptr, order_ptr, w, act_ptr, hidden,
                              inter, stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M, TAIL_M,
                              EVEN_K, PRECISION, TMA)
        elif tl.program_id(0) < n_tiles:
            _gate_up_tile(tl.program_id(0), starts, ends, m_tiles, tile_ends, x_ptr, order_ptr, w, act_ptr,
                          hidden, inter, stride_we, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M,
                          TAIL_M, EVEN_K, PRECISION, TMA)

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
    def _down_tile(t, starts, ends, m_tiles, tile_ends, act_ptr, act_desc, order_ptr, w, y_ptr, hidden,
                   inter, stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TAIL_M: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
        # tile t, the tails as in _gate_up_tile; act_desc (TMA: a [BLOCK_M, BLOCK_K] box) serves
        # the full tiles, the tails read act through pointers
        e, row0, end_row, pid_n = _tile_at(t, starts, ends, m_tiles, tile_ends, tl.cdiv(hidden, BLOCK_N),
                                           BLOCK_M, BLOCK_E, GROUP_M)
        n = end_row - row0
        if TAIL_M == 0:
            _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                       stride_we, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, TMA)
        elif n <= TAIL_M:
            _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                       stride_we, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, False)
        elif n <= BLOCK_M // 2:  # (never taken when TAIL_M is BLOCK_M // 2)
            _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                       stride_we, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, False)
        else:
            _down_rows(act_ptr, act_desc, order_ptr, w, y_ptr, e, row0, end_row, pid_n, hidden, inter,
                       stride_we, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA, TMA)

    @triton.jit
    def down_kernel(act_ptr, act_desc, order_ptr, offs_ptr, w, y_ptr, n_experts, hidden, inter,
                     stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TAIL_M: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                     PERSISTENT: tl.constexpr):
        # one tile per program, or PERSISTENT: every num_programs-th tile
        starts, ends, m_tiles, tile_ends, n_tiles = _tile_table(offs_ptr, n_experts, tl.cdiv(hidden, BLOCK_N),
                                                                BLOCK_M, BLOCK_E)
        if PERSISTENT:
            for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _down_tile(t, starts, ends, m_tiles, tile_ends, act_ptr, act_desc, order_ptr, w, y_ptr,
                           hidden, inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M, TAIL_M,
                           EVEN_K, PRECISION, TMA)
        elif tl.program_id(0) < n_tiles:
            _down_tile(tl.program_id(0), starts, ends, m_tiles, tile_ends, act_ptr, act_desc, order_ptr, w,
                       y_ptr, hidden, inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M, TAIL_M,
                       EVEN_K, PRECISION, TMA)

    @triton.jit
    def down_flat_kernel(act_desc, order_ptr, map_ptr, w_desc, y_ptr, tw_ptr, out_ptr, hidden, inter,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         TOPK: tl.constexpr, SOLE: tl.constexpr):
        # persistent: every num_programs-th tile, the tile loop flattened with the K loop so that
        # Triton pipelines the next tile's loads under this tile's products and stores (a short K
        # loop of its own, a few steps at I = 256, does not pipeline). act_desc: act as [R, inter],
        # box [BLOCK_M, BLOCK_K]; w_desc: w2 as [E * hidden, inter], box [BLOCK_N, BLOCK_K]. The
        # row tiles come from fused_maps.tile_map_kernel's map (five scalar loads per tile, where the
        # experts' scan of _tile_at costs five block-wide reductions: 13-17% of this kernel's
        # time at I = 256); a group's row tiles share a column block in tile order. No tail tiles:
        # the rows past the expert's end (the next expert's, or TMA's zeros) are computed and
        # never stored. SOLE (the top-k sum runs with SOLE too): order_ptr is tile_map_kernel's
        # dest, where ~slot marks a row whose token has no other local slot: that row is weighted
        # (tw_ptr) and written to out[token] with the top-k sum's rounding, where that sum would
        # only have copied it
        n_col = tl.cdiv(hidden, BLOCK_N)
        n_m = tl.load(map_ptr)
        k_tiles = tl.cdiv(inter, BLOCK_K)
        for t in tl.range(tl.program_id(0), n_m * n_col, tl.num_programs(0), flatten=True):
            e, row0, end_row, pid_n = map_tile(t, map_ptr, n_col)
            w_row = e * hidden + pid_n * BLOCK_N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for ki in range(k_tiles):
                a = act_desc.load([row0, ki * BLOCK_K])
                b = w_desc.load([w_row, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            down_store(acc, row0, end_row, pid_n, order_ptr, y_ptr, tw_ptr, out_ptr, hidden, BLOCK_M, BLOCK_N,
                       TOPK, SOLE)

    @triton.jit
    def down_store(acc, row0, end_row, pid_n, order_ptr, y_ptr, tw_ptr, out_ptr, hidden,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOPK: tl.constexpr, SOLE: tl.constexpr):
        # the flat down tile's epilogue: rows below end_row to their slots' rows of y, or (SOLE,
        # a ~slot mark) weighted to out[token] with the top-k sum's rounding
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        if SOLE:
            sole = slots < 0
            slots = tl.where(sole, ~slots, slots)
            scale = tl.load(tw_ptr + slots, mask=sole & row_mask, other=1.0).to(tl.float32)
            dest = tl.where(sole[:, None], out_ptr + (slots // TOPK)[:, None] * hidden,
                            y_ptr + slots[:, None] * hidden) + cols[None, :]
            val = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
            tl.store(dest, val.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _down_short_k_tile(t, starts, ends, m_tiles, tile_ends, act_ptr, order_ptr, w_ptr, y_ptr, hidden,
                           inter, stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, N_PER_PROGRAM: tl.constexpr, BLOCK_E: tl.constexpr,
                           GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
        e, row0, end_row, pid_g = _tile_at(t, starts, ends, m_tiles, tile_ends,
                                           tl.cdiv(tl.cdiv(hidden, BLOCK_N), N_PER_PROGRAM), BLOCK_M,
                                           BLOCK_E, GROUP_M)
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
    def down_short_k_kernel(act_ptr, order_ptr, offs_ptr, w_ptr, y_ptr, n_experts, hidden, inter,
                             stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, N_PER_PROGRAM: tl.constexpr, BLOCK_E: tl.constexpr,
                             GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PERSISTENT: tl.constexpr):
        # inter <= BLOCK_K: a program loads its rows' activations once and walks N_PER_PROGRAM
        # column blocks; the loop over columns is the one Triton pipelines (the next weight tile
        # loads while this one multiplies), where a K loop of a few steps would not pipeline
        starts, ends, m_tiles, tile_ends, n_tiles = _tile_table(
            offs_ptr, n_experts, tl.cdiv(tl.cdiv(hidden, BLOCK_N), N_PER_PROGRAM), BLOCK_M, BLOCK_E)
        if PERSISTENT:
            for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _down_short_k_tile(t, starts, ends, m_tiles, tile_ends, act_ptr, order_ptr, w_ptr, y_ptr,
                                   hidden, inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_PROGRAM,
                                   BLOCK_E, GROUP_M, PRECISION)
        elif tl.program_id(0) < n_tiles:
            _down_short_k_tile(tl.program_id(0), starts, ends, m_tiles, tile_ends, act_ptr, order_ptr, w_ptr,
                               y_ptr, hidden, inter, stride_we, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_PROGRAM,
                               BLOCK_E, GROUP_M, PRECISION)

    @triton.jit
    def topk_sum_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, n_experts, hidden, TOPK: tl.constexpr,
                         BLOCK: tl.constexpr, SOLE: tl.constexpr):
        # a slot of another rank's expert reads nothing: its row of y was never written. SOLE: a
        # token with one local slot is left alone (the flat down kernel wrote its row)
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        if SOLE:
            n_local = 0
            for s in tl.static_range(TOPK):
                e = tl.load(ids_ptr + m * TOPK + s)
                n_local += ((e >= 0) & (e < n_experts)).to(tl.int32)
            todo = n_local != 1
        else:
            todo = True
        if todo:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(TOPK):
                e = tl.load(ids_ptr + m * TOPK + s)
                if (e >= 0) & (e < n_experts):
                    w = tl.load(w_ptr + m * TOPK + s).to(tl.float32)
                    acc += w * tl.load(y_ptr + (m * TOPK + s) * hidden + cols, mask=mask,
                                       other=0.0).to(tl.float32)
            tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
