"""The fused experts' down-side Triton kernels (:mod:`dbo.moe.fused_experts` launches them): the
flat persistent down GEMM, the row-tile map it reads, and the top-k sum.

Three ways to get from the down GEMM's rows to ``out[m] = sum_s w[m, s] * y[m * topk + s]``:

* every row to ``y``, then ``topk_sum_kernel`` (one program per token and column block);
* ``SOLE``: the row of a token whose only local slot it is goes weighted straight to ``out``,
  and the top-k sum leaves that token alone;
* ``SUM``: as ``SOLE``, and each of the other rows to ``y``, then one counter per (token,
  column block) counts the token's rows done; the program whose row completes the count (the
  last of that token's local slots to finish that column block) reads the token's rows back
  and writes ``out[m]`` itself. No top-k sum runs. The counter's atomic is ``acq_rel`` at GPU
  scope after a block barrier, so the last program sees every row the others wrote; nothing
  waits on another program (no spin: it cannot hang), and the sum runs in slot order with the
  top-k sum's arithmetic, so the output is the same bits whichever program finishes last. The
  row-tile map's launch zeroes the counters and writes the zero rows of tokens with no local
  slot (the top-k sum wrote those before).
"""

from __future__ import annotations

__all__ = ["tile_map_kernel", "down_flat_kernel", "topk_sum_kernel"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:
    from dbo.moe.fused_kernels import _grouped_tile, _tile_table

    @triton.jit
    def tile_map_kernel(offs_ptr, map_ptr, n_experts, max_tiles, order_ptr, ids_ptr, dest_ptr, out_ptr, m,
                        hidden, n_col, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_J: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_R: tl.constexpr, SOLE: tl.constexpr, SUM: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
        # the row tiles of BLOCK_M rows, in expert order, for down_flat_kernel: map[0] their
        # count, map[1 + 3j : 4 + 3j] row tile j's expert, first row and the expert's end row.
        # Row tile j belongs to the expert whose tiles start at or before j and end after it:
        # the experts whose tiles end at or before j (their tile ends do not decrease) are
        # counted, and the largest of their tile ends and end rows are tile j's expert's first
        # tile and first row. The programs past the map: SOLE: mark each sorted row whose token
        # has no other local slot (ids_ptr [M, TOPK]): dest[r] = ~order[r] there, order[r] else.
        # SUM: per token (BLOCK_R each) a line of dest ([M, 1 + n_col]): its local slots, then
        # n_col counters, zeroed; and out[m] = 0 where it has no local slot
        n_map = tl.cdiv(max_tiles, BLOCK_J)
        if tl.program_id(0) < n_map:
            starts, ends, m_tiles, tile_ends, total = _tile_table(offs_ptr, n_experts, 1, BLOCK_M, BLOCK_E)
            if tl.program_id(0) == 0:
                tl.store(map_ptr, total)
            j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
            keep = (j < total) & (j < max_tiles)
            before = tile_ends[None, :] <= j[:, None]
            e = tl.sum(before.to(tl.int32), 1)
            first_tile = tl.max(tl.where(before, tile_ends[None, :], 0), 1)
            first_row = tl.max(tl.where(before, ends[None, :], 0), 1)
            end_row = tl.load(offs_ptr + e, mask=keep, other=0)
            out = map_ptr + 1 + 3 * j
            tl.store(out, e, mask=keep)
            tl.store(out + 1, first_row + (j - first_tile) * BLOCK_M, mask=keep)
            tl.store(out + 2, end_row, mask=keep)
        elif SOLE:
            rows = (tl.program_id(0) - n_map) * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < tl.load(offs_ptr + n_experts - 1)
            slots = tl.load(order_ptr + rows, mask=live, other=0)
            ks = tl.arange(0, BLOCK_T)
            ids = tl.load(ids_ptr + (slots // TOPK)[:, None].to(tl.int64) * TOPK + ks[None, :],
                          mask=live[:, None] & (ks < TOPK)[None, :], other=-1)
            n_local = tl.sum(((ids >= 0) & (ids < n_experts)).to(tl.int32), 1)
            tl.store(dest_ptr + rows, tl.where(n_local == 1, ~slots, slots), mask=live)
        elif SUM:
            toks = ((tl.program_id(0) - n_map) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            live = toks < m
            ks = tl.arange(0, BLOCK_T)
            ids = tl.load(ids_ptr + toks[:, None] * TOPK + ks[None, :],
                          mask=live[:, None] & (ks < TOPK)[None, :], other=-1)
            n_local = tl.sum(((ids >= 0) & (ids < n_experts)).to(tl.int32), 1)
            line = dest_ptr + toks * (1 + n_col)
            tl.store(line, n_local, mask=live)
            cs = tl.arange(0, BLOCK_C)
            tl.store(line[:, None] + 1 + cs[None, :], tl.zeros([BLOCK_R, BLOCK_C], tl.int32),
                     mask=live[:, None] & (cs < n_col)[None, :])
            none = live & (n_local == 0)
            if tl.sum(none.to(tl.int32), 0) > 0:
                hs = tl.arange(0, BLOCK_H)
                zero = tl.zeros([BLOCK_R, BLOCK_H], out_ptr.dtype.element_ty)
                for h0 in range(0, hidden, BLOCK_H):
                    tl.store(out_ptr + toks[:, None] * hidden + (h0 + hs)[None, :], zero,
                             mask=none[:, None] & (h0 + hs < hidden)[None, :])

    @triton.jit
    def _sum_last_rows(tok, last, cols, y_ptr, ids_ptr, tw_ptr, out_ptr, n_experts, hidden,
                       TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SUM_ROWS: tl.constexpr):
        # out[tok] = sum over tok's local slots s, in slot order, of w[tok, s] * y[tok * TOPK + s]
        # (the top-k sum's arithmetic) for the rows marked last, gathered SUM_ROWS at a time: the
        # i-th last row is the one where the running count of last rows reaches i + 1
        n_last = tl.sum(last.to(tl.int32), 0)
        rank = tl.where(last, tl.cumsum(last.to(tl.int32), 0), 0)[None, :]
        toks = tok[None, :]
        col_mask = cols < hidden
        for j0 in range(0, n_last, SUM_ROWS):
            if True:
                j = j0 + tl.arange(0, SUM_ROWS)
                t = tl.sum(tl.where(rank == j[:, None] + 1, toks, 0), 1)
                live = j < n_last
                acc = tl.zeros([SUM_ROWS, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(TOPK):
                    e = tl.load(ids_ptr + t * TOPK + s, mask=live, other=-1)
                    loc = live & (e >= 0) & (e < n_experts)
                    w = tl.load(tw_ptr + t * TOPK + s, mask=loc, other=0.0).to(tl.float32)
                    v = tl.load(y_ptr + (t * TOPK + s)[:, None] * hidden + cols[None, :],
                                mask=loc[:, None] & col_mask[None, :], other=0.0,
                                cache_modifier=".cg").to(tl.float32)
                    acc = tl.where(loc[:, None], acc + w[:, None] * v, acc)
                tl.store(out_ptr + t[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=live[:, None] & col_mask[None, :])

    @triton.jit
    def down_flat_kernel(act_desc, order_ptr, map_ptr, w_desc, y_ptr, tw_ptr, out_ptr, ids_ptr, sum_ptr,
                         n_experts, hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TOPK: tl.constexpr,
                         SOLE: tl.constexpr, SUM: tl.constexpr, SUM_ROWS: tl.constexpr,
                         PROBE: tl.constexpr = 0):
        # persistent: every num_programs-th tile, the tile loop flattened with the K loop so that
        # Triton pipelines the next tile's loads under this tile's products and stores (a short K
        # loop of its own, a few steps at I = 256, does not pipeline). act_desc: act as [R, inter],
        # box [BLOCK_M, BLOCK_K]; w_desc: w2 as [E * hidden, inter], box [BLOCK_N, BLOCK_K]. The
        # row tiles come from tile_map_kernel's map (three scalar loads per tile, where the
        # experts' scan of _tile_at costs five block-wide reductions: 13-17% of this kernel's
        # time at I = 256); GROUP_M row tiles share a column block in tile order. No tail tiles:
        # the rows past the expert's end (the next expert's, or TMA's zeros) are computed and
        # never stored. SOLE (the top-k sum runs with SOLE too): order_ptr is tile_map_kernel's
        # dest, where ~slot marks a row whose token has no other local slot: that row is weighted
        # (tw_ptr) and written to out[token] with the top-k sum's rounding, where that sum would
        # only have copied it. SUM (no top-k sum after it): the same for the rows of tokens with
        # one local slot (sum_ptr: tile_map_kernel's line per token, its local slots and a
        # counter per column block); the others go to y and count themselves in, and the row
        # that completes its token's count sums the token's rows (the module docstring)
        n_col = tl.cdiv(hidden, BLOCK_N)
        n_m = tl.load(map_ptr)
        k_tiles = tl.cdiv(inter, BLOCK_K)
        for t in tl.range(tl.program_id(0), n_m * n_col, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(t, n_m, n_col, GROUP_M)
            e = tl.load(map_ptr + 1 + 3 * pid_m)
            row0 = tl.load(map_ptr + 2 + 3 * pid_m)
            end_row = tl.load(map_ptr + 3 + 3 * pid_m)
            w_row = e * hidden + pid_n * BLOCK_N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for ki in range(k_tiles):
                a = act_desc.load([row0, ki * BLOCK_K])
                b = w_desc.load([w_row, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < end_row
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            mask = row_mask[:, None] & (cols < hidden)[None, :]
            if SUM:
                tok = slots // TOPK
                line = sum_ptr + tok * (1 + n_col)
                n_local = tl.load(line, mask=row_mask, other=0)
                sole = n_local == 1
                scale = tl.load(tw_ptr + slots, mask=sole & row_mask, other=1.0).to(tl.float32)
                dest = tl.where(sole[:, None], out_ptr + tok[:, None] * hidden,
                                y_ptr + slots[:, None] * hidden) + cols[None, :]
                val = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
                tl.store(dest, val.to(y_ptr.dtype.element_ty), mask=mask)
                multi = row_mask & (n_local > 1)
                if PROBE != 1:
                    tl.debug_barrier()  # every thread's rows stored before any counts them in
                if PROBE == 2:
                    done = tl.atomic_add(line + 1 + pid_n, 1, mask=multi, sem="relaxed", scope="gpu")
                elif PROBE == 4:
                    done = n_local
                else:
                    done = tl.atomic_add(line + 1 + pid_n, 1, mask=multi, sem="acq_rel", scope="gpu")
                if PROBE < 3:
                    _sum_last_rows(tok, multi & (done == n_local - 1), cols, y_ptr, ids_ptr, tw_ptr, out_ptr,
                                   n_experts, hidden, TOPK, BLOCK_M, BLOCK_N, SUM_ROWS)
            elif SOLE:
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
