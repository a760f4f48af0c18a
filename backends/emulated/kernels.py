"""The emulated calls' GPU work in a few kernels, as DeepEP's is in one or two per call.

A DeepEP low-latency dispatch is one send kernel (the fp8 cast of each token, the messages per
(token, expert) pair) and one receive kernel (the pairs into the experts' slabs); a combine is
one send kernel (each pair's expert row into the send buffer) and one receive kernel (the
weighted sum per token). Written as torch ops, the emulation's bookkeeping alone (where each
pair lands, the counts, the bytes that leave the host) is some fifty small kernels per call, whose
launches and gaps would be timed as communication. Here:

* :func:`ll_send` is one launch: its first program routes (counts per (local expert, source
  rank) key, their offsets, each pair's row by an atomic cursor, the bytes that leave the host in
  1/1024 units), the others cast one token each to fp8 with its per-128 scales (or copy it).
* :func:`ll_unpack` is one launch: each program copies one pair's row and scales into its slab
  row and writes its ``src_info``.
* :func:`ll_remote_units` is one launch: the bytes a combine sends off the host (a group
  combine masks whole experts, so it counts its own pairs).

The send kernels can stamp the GPU's global timer (ns) when they begin (``begun``): the call's
start, from which a NIC-like link counts the call's fixed cost, so that the emulation's own work
(routing, the cast, packing) runs inside the modelled time as DeepEP's own kernels do in its
published figures (:func:`dbo.backends.simulated_link.wall_wait.nic_flow`).
* :func:`ht_receive` is the receive of a normal-mode dispatch in one launch, once the host knows
  the received count: each token's rows, scales, local top-k and weights into the rows received
  from each rank it is "sent" to; :func:`ht_combine` is a normal-mode combine's receive, each
  token's rows summed, in one launch.

The torch route (:meth:`EmulatedBuffer.pair_rows`) is the reference the GPU test holds these to;
the pairs of one (local expert, source rank) key take their rows in atomic order, not token order
(DeepEP's receive order is not the token order either). Needs Triton and CUDA
(:data:`AVAILABLE`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dbo.kernels.triton_launch import cdiv, launch, next_pow2

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    AVAILABLE = True
except ImportError:  # pragma: no cover - the CPU install has no Triton
    AVAILABLE = False

__all__ = ["AVAILABLE", "usable", "ll_send", "ll_unpack", "ll_remote_units", "HTLayout", "ht_layout",
           "ht_receive", "ht_combine"]

#: the fp8 cast's block, as :mod:`dbo.backends.fp8`'s
_BLOCK = 128
_FP8_MAX = 448.0


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensors like ``t`` (CUDA, with Triton)."""
    return AVAILABLE and t.is_cuda


if AVAILABLE:
    @triton.jit
    def _route(topk_ptr, share_ptr, hist_ptr, cursor_ptr, rows_ptr, rows0_ptr, count_ptr,
               layout_ptr, units_ptr, num_pairs, src_pairs, n, n_local, cap,
               E_PAD: tl.constexpr, L_PAD: tl.constexpr, PAIRS: tl.constexpr):
        # key = local expert * n + source rank: the pairs of one key are contiguous in its slab
        e = tl.arange(0, E_PAD)
        num_keys = n_local * n
        tl.store(hist_ptr + e, tl.zeros([E_PAD], tl.int32), mask=e < num_keys)
        tl.debug_barrier()
        units = tl.zeros([PAIRS], tl.int64)
        for start in range(0, num_pairs, PAIRS):
            p = start + tl.arange(0, PAIRS)
            ids = tl.load(topk_ptr + p % src_pairs, mask=p < num_pairs, other=-1)
            valid = ids >= 0
            safe = tl.where(valid, ids, 0)
            dest = safe // n_local
            key = (safe % n_local) * n + dest
            tl.atomic_add(hist_ptr + key, tl.full([PAIRS], 1, tl.int32), mask=valid)
            units += tl.where(valid, tl.load(share_ptr + dest, mask=valid, other=0), 0)
        tl.store(units_ptr, tl.sum(units, 0))
        tl.debug_barrier()
        hist = tl.load(hist_ptr + e, mask=e < num_keys, other=0, volatile=True)
        excl = tl.cumsum(hist, 0) - hist
        tl.store(cursor_ptr + e, excl, mask=e < num_keys)
        tl.debug_barrier()
        # each key's first row inside its expert's slab; each expert's rows and per-rank ranges
        first = tl.load(cursor_ptr + (e // n) * n, mask=e < num_keys, other=0, volatile=True)
        begin = excl - first
        tl.store(layout_ptr + e, (begin.to(tl.int64) << 32) | hist.to(tl.int64), mask=e < num_keys)
        le = tl.arange(0, L_PAD)
        lo = tl.load(cursor_ptr + le * n, mask=le < n_local, other=0, volatile=True)
        hi = tl.load(cursor_ptr + le * n + n - 1, mask=le < n_local, other=0, volatile=True) \
            + tl.load(hist_ptr + le * n + n - 1, mask=le < n_local, other=0, volatile=True)
        tl.store(count_ptr + le, hi - lo, mask=le < n_local)
        tl.debug_barrier()
        tl.store(cursor_ptr + e, begin, mask=e < num_keys)
        tl.debug_barrier()
        for start in range(0, num_pairs, PAIRS):
            p = start + tl.arange(0, PAIRS)
            ids = tl.load(topk_ptr + p % src_pairs, mask=p < num_pairs, other=-1)
            valid = ids >= 0
            safe = tl.where(valid, ids, 0)
            local = safe % n_local
            key = local * n + safe // n_local
            pos = tl.atomic_add(cursor_ptr + key, tl.full([PAIRS], 1, tl.int32), mask=valid)
            row = local.to(tl.int64) * cap + pos.to(tl.int64)
            spare = (cap * n_local).to(tl.int64)
            tl.store(rows_ptr + p, tl.where(valid, row, spare), mask=p < num_pairs)
            tl.store(rows0_ptr + p, tl.where(valid, row, 0), mask=p < num_pairs)

    @triton.jit
    def _send(x_ptr, q_ptr, scales_ptr, topk_ptr, share_ptr, hist_ptr, cursor_ptr, rows_ptr,
              rows0_ptr, count_ptr, layout_ptr, units_ptr, begun_ptr, num_pairs, src_pairs, n, n_local, cap,
              hidden, FP8: tl.constexpr, E_PAD: tl.constexpr, L_PAD: tl.constexpr, PAIRS: tl.constexpr,
              BLOCKS: tl.constexpr, STAMP: tl.constexpr):
        pid = tl.program_id(0)
        if pid == 0:
            if STAMP:
                tl.store(begun_ptr, globaltimer())
            _route(topk_ptr, share_ptr, hist_ptr, cursor_ptr, rows_ptr, rows0_ptr, count_ptr,
                   layout_ptr, units_ptr, num_pairs, src_pairs, n, n_local, cap, E_PAD, L_PAD, PAIRS)
        elif FP8:
            t = (pid - 1).to(tl.int64)
            b = tl.arange(0, BLOCKS)[:, None]
            c = tl.arange(0, 128)[None, :]
            mask = (b * 128 < hidden) & (c < 128)
            v = tl.load(x_ptr + t * hidden + b * 128 + c, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(v), 1), 1e-4)
            # as torch's: the scale times the float32 reciprocal of 448 (torch multiplies by the
            # reciprocal of a scalar divisor), the values by an IEEE division (Triton's plain one
            # is approximate)
            inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.full(amax.shape, 448.0, tl.float32))
            scale = amax * inv
            q = tl.clamp(tl.math.div_rn(v, tl.broadcast_to(scale[:, None], v.shape)), -448.0, 448.0)
            tl.store(q_ptr + t * hidden + b * 128 + c, q.to(tl.float8e4nv), mask=mask)
            bb = tl.arange(0, BLOCKS)
            tl.store(scales_ptr + t * (hidden // 128) + bb, scale, mask=bb * 128 < hidden)

    @triton.jit
    def _unpack(q_ptr, scales_ptr, rows_ptr, src_ptr, slab_ptr, slab_scales_ptr, k, src_pairs, row_bytes,
                num_scales, SCALES: tl.constexpr, BYTES: tl.constexpr, S_PAD: tl.constexpr):
        p = tl.program_id(0)
        token = (p % src_pairs) // k
        row = tl.load(rows_ptr + p)
        for off in range(0, row_bytes, BYTES):
            o = off + tl.arange(0, BYTES)
            m = o < row_bytes
            tl.store(slab_ptr + row * row_bytes + o,
                     tl.load(q_ptr + token.to(tl.int64) * row_bytes + o, mask=m), mask=m)
        if SCALES:
            s = tl.arange(0, S_PAD)
            m = s < num_scales
            tl.store(slab_scales_ptr + row * num_scales + s,
                     tl.load(scales_ptr + token.to(tl.int64) * num_scales + s, mask=m), mask=m)
        tl.store(src_ptr + row, token.to(tl.int32))

    @triton.jit
    def _units(topk_ptr, share_ptr, units_ptr, begun_ptr, num_pairs, src_pairs, n_local, PAIRS: tl.constexpr,
               STAMP: tl.constexpr):
        if STAMP:
            tl.store(begun_ptr, globaltimer())
        units = tl.zeros([PAIRS], tl.int64)
        for start in range(0, num_pairs, PAIRS):
            p = start + tl.arange(0, PAIRS)
            ids = tl.load(topk_ptr + p % src_pairs, mask=p < num_pairs, other=-1)
            valid = ids >= 0
            dest = tl.where(valid, ids, 0) // n_local
            units += tl.where(valid, tl.load(share_ptr + dest, mask=valid, other=0), 0)
        tl.store(units_ptr, tl.sum(units, 0))

    @triton.jit
    def _ht_receive(q_ptr, scales_ptr, topk_ptr, w_ptr, in_rank_ptr, pos_ptr, recv_q_ptr, recv_scales_ptr,
                    recv_ids_ptr, recv_w_ptr, row_src_ptr, t_count, n, n_local, k, row_bytes, num_scales,
                    SCALES: tl.constexpr, BYTES: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, K_PAD)
        jm = j < k
        ids = tl.load(topk_ptr + t * k + j, mask=jm, other=-1)
        w = tl.load(w_ptr + t * k + j, mask=jm, other=0.0).to(tl.float32)
        for s in range(0, n):
            if tl.load(in_rank_ptr + t * n + s) != 0:
                r = tl.load(pos_ptr + s * t_count + t)
                for off in range(0, row_bytes, BYTES):
                    o = off + tl.arange(0, BYTES)
                    m = o < row_bytes
                    row = tl.load(q_ptr + t * row_bytes + o, mask=m)
                    tl.store(recv_q_ptr + r * row_bytes + o, row, mask=m)
                if SCALES:
                    c = tl.arange(0, S_PAD)
                    cm = c < num_scales
                    tl.store(recv_scales_ptr + r * num_scales + c,
                             tl.load(scales_ptr + t * num_scales + c, mask=cm), mask=cm)
                mine = (ids >= 0) & (tl.where(ids >= 0, ids, 0) // n_local == s)
                tl.store(recv_ids_ptr + r * k + j, tl.where(mine, tl.where(ids >= 0, ids, 0) % n_local, -1),
                         mask=jm)
                tl.store(recv_w_ptr + r * k + j, tl.where(mine, w, 0.0), mask=jm)
                tl.store(row_src_ptr + r, t)

    @triton.jit
    def _ht_combine(x_ptr, in_rank_ptr, pos_ptr, out_ptr, t_count, n, hidden, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        hm = h < hidden
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n):
            if tl.load(in_rank_ptr + t * n + s) != 0:
                r = tl.load(pos_ptr + s * t_count + t)
                acc += tl.load(x_ptr + r * hidden + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def _ht_count(topk_ptr, in_rank_ptr, block_ptr, cnt_ptr, t_count, n, n_local, num_hosts, per_host_ranks,
                  my_host, my_rank, host_base, expert_base, local_base, off_index,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, N_PAD: tl.constexpr, H_PAD: tl.constexpr):
        # one block of tokens: their (token, rank) and (token, host) tables, the counts by atomics
        pid = tl.program_id(0)
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < t_count
        s = tl.arange(0, N_PAD)
        hh = tl.arange(0, H_PAD)
        member = tl.zeros([BLOCK_T, N_PAD], tl.int32)
        hosts = tl.zeros([BLOCK_T, H_PAD], tl.int32)
        for j in tl.static_range(K):
            ids = tl.load(topk_ptr + t.to(tl.int64) * K + j, mask=tm, other=-1)
            valid = ids >= 0
            safe = tl.where(valid, ids, 0)
            d = safe // n_local
            member = tl.where((d[:, None] == s[None, :]) & valid[:, None], 1, member)
            hosts = tl.where(((d // per_host_ranks)[:, None] == hh[None, :]) & valid[:, None], 1, hosts)
            tl.atomic_add(cnt_ptr + expert_base + safe, tl.full([BLOCK_T], 1, tl.int32), mask=valid)
            tl.atomic_add(cnt_ptr + local_base + safe % n_local, tl.full([BLOCK_T], 1, tl.int32), mask=valid)
        sm = s < n
        tl.store(in_rank_ptr + t[:, None].to(tl.int64) * n + s[None, :], member.to(tl.uint8),
                 mask=tm[:, None] & sm[None, :])
        col = tl.sum(member, 0)
        tl.store(block_ptr + pid * N_PAD + s, col)
        tl.atomic_add(cnt_ptr + s, col, mask=sm)
        hcol = tl.sum(hosts, 0)
        tl.atomic_add(cnt_ptr + host_base + hh, hcol, mask=hh < num_hosts)
        tl.atomic_add(cnt_ptr + off_index, tl.sum(tl.where((hh != my_host) & (hh < num_hosts), hcol, 0), 0))
        tl.atomic_add(cnt_ptr + off_index + 1, tl.sum(tl.where((s != my_rank) & sm, col, 0), 0))

    @triton.jit
    def _ht_positions(in_rank_ptr, block_ptr, cnt_ptr, pos_ptr, counts_ptr, units_ptr, t_count, n, n_local,
                      local_base, off_index, BLOCK_T: tl.constexpr, N_PAD: tl.constexpr, L_PAD: tl.constexpr):
        # each (rank, token)'s received row: the rows of the ranks before it, of its rank's tokens in
        # the blocks before (row pid of block_ptr, an exclusive prefix), and in its block up to it
        pid = tl.program_id(0)
        s = tl.arange(0, N_PAD)
        sm = s < n
        per_rank = tl.load(cnt_ptr + s, mask=sm, other=0)
        rank_off = tl.cumsum(per_rank, 0) - per_rank
        before = tl.load(block_ptr + pid * N_PAD + s)  # the blocks before this one, per rank
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < t_count
        m = tl.load(in_rank_ptr + t[:, None].to(tl.int64) * n + s[None, :], mask=tm[:, None] & sm[None, :],
                    other=0).to(tl.int32)
        pos = (rank_off + before)[None, :] + tl.cumsum(m, 0) - 1
        tl.store(pos_ptr + s[None, :].to(tl.int64) * t_count + t[:, None], pos.to(tl.int64),
                 mask=tm[:, None] & sm[None, :])
        if pid == 0:
            tl.store(counts_ptr, tl.sum(per_rank, 0).to(tl.int64))
            le = tl.arange(0, L_PAD)
            local = tl.load(cnt_ptr + local_base + le, mask=le < n_local, other=0)
            tl.store(counts_ptr + 1 + le, local.to(tl.int64), mask=le < n_local)
            tl.store(units_ptr, tl.load(cnt_ptr + off_index).to(tl.int64) * 1024)


def ll_send(x: torch.Tensor, topk_idx: torch.Tensor, share_q: torch.Tensor, slot: dict[str, torch.Tensor],
            *, n: int, n_local: int, cap: int, use_fp8: bool, extra: int = 0,
            begun: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The send of a low-latency dispatch, one launch.

    ``x`` ``[T, hidden]`` bf16; ``topk_idx`` ``[T, k]`` int64 (``-1``: no expert); ``share_q``
    ``[n]`` int64, each destination rank's share of its bytes that crosses the link, x 1024;
    ``extra``: pairs that arrive beyond the rank's own, copies of its first ones in turn (the
    peers' pairs a hot rank receives). Writes the slot's ``count`` ``[L]`` int32 and
    ``layout_range`` ``[L, n]`` int64 (DeepEP's ``(begin << 32) | count``), and into ``begun``
    (``[1]`` int64, if given) the global timer when the kernel began.

    Returns ``(q, scales, rows, rows0, units_q)``: the send buffer (``[T, hidden]`` fp8 and
    ``[T, hidden / 128]`` float32 with ``use_fp8``, else ``x`` and None); each pair's slab row,
    ``[T * k + extra]`` int64 (``L * cap`` for no expert); the same with 0 for no expert; the
    pairs that leave the host x 1024, ``[1]`` int64.
    """
    t, k = topk_idx.shape
    hidden = x.shape[1]
    dev = x.device
    num_keys = n_local * n
    hist = torch.empty(num_keys, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_keys, dtype=torch.int32, device=dev)
    rows = torch.empty(t * k + extra, dtype=torch.int64, device=dev)
    rows0 = torch.empty(t * k + extra, dtype=torch.int64, device=dev)
    units = torch.empty(1, dtype=torch.int64, device=dev)
    x = x.contiguous()
    if use_fp8:
        q = torch.empty((t, hidden), dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.empty((t, hidden // _BLOCK), dtype=torch.float32, device=dev)
    else:
        q, scales = x, None
    launch(_send, (1 + (t if use_fp8 else 0),), (
        x, q, scales if scales is not None else units, topk_idx.contiguous(), share_q, hist, cursor,
        rows, rows0, slot["count"], slot["layout_range"], units, units if begun is None else begun,
        t * k + extra, max(t * k, 1), n, n_local, cap, hidden), dict(
        FP8=use_fp8, E_PAD=next_pow2(num_keys), L_PAD=next_pow2(n_local), PAIRS=1024,
        BLOCKS=next_pow2(max(hidden // _BLOCK, 1)), STAMP=begun is not None, num_warps=4))
    return q, scales, rows, rows0, units


def ll_unpack(q: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, k: int,
              slot: dict[str, torch.Tensor]) -> None:
    """The receive of a low-latency dispatch, one launch: pair ``p`` (token ``p % (T * k) // k``) of the
    send buffer ``q`` ``[T, hidden]`` (and ``scales``) into slab row ``rows[p]`` of the slot's
    ``x`` (and ``scales``), its token into ``src_info``."""
    num_pairs = rows.numel()
    if num_pairs == 0:
        return
    row_bytes = q.shape[1] * q.element_size()
    num_scales = 0 if scales is None else scales.shape[1]
    slab = slot["x"].view(torch.uint8)
    slab_scales = slot["scales"] if scales is not None else slot["src_info"]
    launch(_unpack, (num_pairs,), (
        q.view(torch.uint8), scales if scales is not None else slot["src_info"], rows, slot["src_info"],
        slab, slab_scales, k, max(q.shape[0] * k, 1), row_bytes, max(num_scales, 1)), dict(
        SCALES=scales is not None, BYTES=min(4096, next_pow2(row_bytes)), S_PAD=next_pow2(max(num_scales, 1)),
        num_warps=4))


def ll_remote_units(topk_idx: torch.Tensor, share_q: torch.Tensor, n_local: int, extra: int = 0,
                    begun: torch.Tensor | None = None) -> torch.Tensor:
    """The pairs of ``topk_idx`` ``[T, k]`` and ``extra`` copies of its first pairs in turn that
    leave the host, x 1024 (``share_q`` per destination rank), ``[1]`` int64, one launch; into
    ``begun`` (``[1]`` int64, if given) the global timer when it began."""
    units = torch.empty(1, dtype=torch.int64, device=topk_idx.device)
    launch(_units, (1,), (topk_idx.contiguous(), share_q, units, units if begun is None else begun,
                          topk_idx.numel() + extra, max(topk_idx.numel(), 1), n_local),
           dict(PAIRS=1024, STAMP=begun is not None, num_warps=4))
    return units


@dataclass
class HTLayout:
    """A normal-mode dispatch's layout, counted on the device by :func:`ht_layout`: DeepEP's
    ``get_dispatch_layout`` results (``per_rank [N]``, ``per_host [H]`` or None, ``per_expert
    [E]`` int32, ``in_rank [T, N]`` bool) and what the emulated dispatch needs of them: ``pos
    [N * T]`` int64 (the received row of (rank ``s``, token ``t``) at ``s * T + t``: the rows
    before it in (rank, token) order), ``counts [1 + L]`` int64 (the rows received, then the
    pairs per local expert), ``units [1]`` int64 (the (token, other host) rows x 1024) and
    ``other [1]`` int32 (the (token, other rank) rows)."""

    in_rank: torch.Tensor
    per_rank: torch.Tensor
    per_host: torch.Tensor | None
    per_expert: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    units: torch.Tensor
    other: torch.Tensor


def ht_layout(topk_idx: torch.Tensor, *, n: int, n_local: int, num_hosts: int, rank: int) -> HTLayout:
    """The layout of a normal-mode dispatch of ``topk_idx`` ``[T, k]`` int64 (global expert ids,
    -1 for none) for rank ``rank`` of ``n`` ranks of ``n_local`` experts, ``num_hosts`` hosts
    of ``n // num_hosts`` ranks: a zeroing, two launches and a prefix sum (the torch route is
    some forty small kernels). ``T`` must be positive."""
    t, k = topk_idx.shape
    dev = topk_idx.device
    num_experts = n * n_local
    n_pad = next_pow2(n)
    block_t = max(16, min(256, 4096 // n_pad))
    blocks = cdiv(t, block_t)
    host_base, expert_base = n, n + num_hosts
    local_base = expert_base + num_experts
    off_index = local_base + n_local
    cnt = torch.zeros(off_index + 2, dtype=torch.int32, device=dev)
    in_rank = torch.empty((t, n), dtype=torch.bool, device=dev)
    # row 0 stays zero: after the prefix sum, row b + 1 holds the tokens of blocks <= b per rank
    block = torch.zeros((blocks + 1, n_pad), dtype=torch.int32, device=dev)
    per_host = n // num_hosts
    launch(_ht_count, (blocks,), (topk_idx.contiguous(), in_rank.view(torch.uint8), block[1:], cnt, t, n,
                                  n_local, num_hosts, per_host, rank // per_host, rank, host_base,
                                  expert_base, local_base, off_index),
           dict(K=k, BLOCK_T=block_t, N_PAD=n_pad, H_PAD=next_pow2(num_hosts), num_warps=4))
    torch.cumsum(block, 0, out=block)
    pos = torch.empty(n * t, dtype=torch.int64, device=dev)
    counts = torch.empty(1 + n_local, dtype=torch.int64, device=dev)
    units = torch.empty(1, dtype=torch.int64, device=dev)
    launch(_ht_positions, (blocks,), (in_rank.view(torch.uint8), block, cnt, pos, counts, units, t, n,
                                      n_local, local_base, off_index),
           dict(BLOCK_T=block_t, N_PAD=n_pad, L_PAD=next_pow2(n_local), num_warps=4))
    return HTLayout(in_rank, cnt[:n], cnt[host_base:expert_base] if num_hosts > 1 else None,
                    cnt[expert_base:local_base], pos, counts, units, cnt[off_index + 1:off_index + 2])


def ht_receive(q: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor,
               topk_weights: torch.Tensor, in_rank: torch.Tensor, pos: torch.Tensor, m_recv: int, n_local: int
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The receive of a normal-mode dispatch, one launch. ``q`` ``[T, hidden]`` (the send buffer;
    ``scales`` ``[T, hidden / 128]`` float32 with fp8), ``topk_idx`` ``[T, k]`` int64,
    ``topk_weights`` ``[T, k]``, ``in_rank`` ``[T, N]`` bool, ``pos`` ``[N * T]`` int64 (the
    received row of (rank ``s``, token ``t``) at ``s * T + t``, where ``in_rank[t, s]``),
    ``m_recv`` rows received. Returns ``(recv_q [M, hidden], recv_scales [M, hidden / 128] or
    None, recv_ids [M, k] int64 (local ids, -1 for other ranks' experts), recv_weights [M, k]
    float32, row_src [M] int64)``."""
    t, k = topk_idx.shape
    n = in_rank.shape[1]
    dev = q.device
    recv_q = torch.empty((m_recv, q.shape[1]), dtype=q.dtype, device=dev)
    recv_scales = None if scales is None else torch.empty((m_recv, scales.shape[1]), dtype=scales.dtype,
                                                          device=dev)
    recv_ids = torch.empty((m_recv, k), dtype=torch.int64, device=dev)
    recv_w = torch.empty((m_recv, k), dtype=torch.float32, device=dev)
    row_src = torch.empty(m_recv, dtype=torch.int64, device=dev)
    if m_recv == 0 or t == 0:
        return recv_q, recv_scales, recv_ids, recv_w, row_src
    row_bytes = q.shape[1] * q.element_size()
    num_scales = 0 if scales is None else scales.shape[1]
    launch(_ht_receive, (t,), (
        q.contiguous().view(torch.uint8), scales if scales is not None else recv_w, topk_idx.contiguous(),
        topk_weights.contiguous(), in_rank.contiguous().view(torch.uint8), pos, recv_q.view(torch.uint8),
        recv_scales if recv_scales is not None else recv_w, recv_ids, recv_w, row_src, t, n, n_local, k,
        row_bytes, max(num_scales, 1)), dict(
        SCALES=scales is not None, BYTES=min(4096, next_pow2(row_bytes)), S_PAD=next_pow2(max(num_scales, 1)),
        K_PAD=next_pow2(k), num_warps=4))
    return recv_q, recv_scales, recv_ids, recv_w, row_src


def ht_combine(x: torch.Tensor, in_rank: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The receive of a normal-mode combine, one launch: token ``t``'s rows ``x[pos[s * T + t]]``
    over the ranks ``s`` with ``in_rank[t, s]``, summed in float32, ``[T, hidden]`` in ``x``'s
    dtype."""
    t, n = in_rank.shape
    hidden = x.shape[1]
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(1024, next_pow2(hidden))
    launch(_ht_combine, (t, cdiv(hidden, block)),
           (x.contiguous(), in_rank.contiguous().view(torch.uint8), pos, out, t, n, hidden),
           dict(BLOCK=block, num_warps=4))
    return out
