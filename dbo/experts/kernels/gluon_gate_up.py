"""The fused experts' gate/up GEMM as a warp-specialized Hopper kernel, written in Gluon
(Triton's explicit-layout language), for :func:`dbo.experts.kernels.fused_experts.launch_gate_up` where the
tile says so (``GemmConfig.ws``).

``act[r] = silu(x[t] @ g_e.T) * (x[t] @ u_e.T)`` for each sorted row ``r`` of expert ``e``
(``t = order[r] // topk``), the same numbers as the Triton kernel (bit for bit on an H200: the
same K order of the same MMAs).

The Triton kernel has each program's warps both gather the rows (per-thread async copies) and
issue the MMAs. Here one persistent program per SM splits that work between partitions:

* the loader (``LOAD_WARPS`` warps): per K step it waits for a free ring slot, issues the TMA
  copies of the gate and the up weight tile into one ``[2 * BN, BK]`` buffer (one thread), and
  each thread's async copies of the gathered ``x`` rows, whose completion arrives on the slot's
  barrier (``cp.async.mbarrier.arrive.noinc``: the barrier counts the loader's threads plus the
  TMA's arrival). Rows past the expert's end are filled with zeros and never read from memory;
* the MMA partition (the default, one warpgroup per 64 rows): per K step it waits for the slot
  and issues one asynchronous ``warpgroup_mma`` of ``2 * BN`` columns (the gate and the up tile
  side by side: the rows' tile is read from shared memory once per step, where two MMAs of
  ``BN`` columns read it twice), then waits for the previous step's and releases that slot; per
  tile it applies ``silu(gate) * up`` and stores the rows below the expert's end.

The loads run up to ``STAGES`` K steps ahead, across tile boundaries (the next tile's loads go on
under this tile's epilogue). The row tiles come from :func:`dbo.experts.kernels.fused_maps.tile_map`
(``BM`` rows of one expert; the flat down kernel reads the same map); tile ``t`` is row tile
``pid_m`` of column block ``pid_n``, the row tiles of a group of the map (of one expert) one after
the other per column block in tile order.

``split`` (``GemmConfig.split``): where the tiles do not fill the programs' last round (at 256
rows per expert and 32 experts, ~290 tiles are 2.2 rounds of 132 programs), each tile of that
round is split along K into up to ``split`` shares, one unit each, so the round spreads over the
programs. A share writes its float32 partial and counts itself in with one atomic; the last to
count in adds the tile's partials in share order (so the sum is the same whoever finishes last:
run to run the same bits, not the unsplit kernel's) and stores the tile. Nobody waits on
another program, so it cannot hang when not every program is resident. On an H200 the split
(up to four shares) took the kernel alone to 0.89-0.93x the unsplit kernel's time at I=256, 32
experts, T=8192 and 16384 (``tests/gpu/probe_gate_up_split.py`` at 88cef6a, docs/performance.md).

On an H200 (``tests/gpu/probe_gate_up_ws.py`` at 88cef6a, docs/performance.md) the 128-row tile
took 0.90-0.95x the Triton tile's time from ~512 rows per expert and 1.08-1.18x at 128-256 rows
per expert with few experts (fewer, larger tiles fill the last wave worse).

It runs on a Hopper GPU where :func:`available` says so (Triton with Gluon's Hopper API,
bf16/fp16, ``hidden % 64 == 0``, ``I % BN == 0``, 16-byte aligned contiguous operands);
elsewhere the caller takes the Triton kernel (:func:`dbo.experts.kernels.fused_experts.runs_ws`).
"""

from __future__ import annotations

import torch

from dbo.kernels.triton_launch import Desc, cdiv, launch

__all__ = ["available", "launch_gate_up_ws", "gate_up_ws_kernel"]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # no Triton, or one without Gluon's Hopper API
    gluon = None


if gluon is not None:

    @gluon.jit
    def _tile(t, map_ptr, n_col):
        # tile t -> (expert, first row, the expert's end row, column block), as
        # fused_maps.map_tile: a group's row tiles (of one expert) share a column block in tile
        # order; a map entry is MAP_ENTRY (5) int32
        q = t // n_col
        g0 = gl.load(map_ptr + 4 + 5 * q)
        gn = gl.load(map_ptr + 5 + 5 * q)
        local = t - g0 * n_col
        pid_m = g0 + local % gn
        e = gl.load(map_ptr + 1 + 5 * pid_m)
        row0 = gl.load(map_ptr + 2 + 5 * pid_m)
        end_row = gl.load(map_ptr + 3 + 5 * pid_m)
        return e, row0, end_row, local // gn

    @gluon.jit
    def _plan(map_ptr, n_col, k_steps, SPLIT: gl.constexpr):
        # (tiles, whole tiles, shares): the tiles of the last round, which fewer programs than
        # there are take, each split along K into `shares` units (at most SPLIT), so that the
        # round's work spreads over the programs; units: the whole tiles, then the split ones
        n_tiles = gl.load(map_ptr) * n_col
        if SPLIT > 1:
            progs = gl.num_programs(0)
            rest = n_tiles % progs
            # every share at least one K step (an empty one would free a ring slot it never took)
            shares = gl.minimum(gl.minimum(progs // gl.maximum(rest, 1), SPLIT), k_steps)
            shares = gl.maximum(shares * (rest > 0).to(gl.int32), 1)
            whole = n_tiles - rest * (shares > 1).to(gl.int32)
        else:
            shares = n_tiles * 0 + 1
            whole = n_tiles
        return whole, shares, whole + (n_tiles - whole) * shares

    @gluon.jit
    def _unit(v, whole, shares, k_steps):
        # unit v -> (tile, first and end K step, its split slot, or -1 for a whole tile)
        split = (v >= whole).to(gl.int32)
        j = (v - whole) * split
        t = v + split * (whole + j // shares - v)
        s = j % shares
        k0 = split * (s * k_steps // shares)
        k1 = k_steps + split * ((s + 1) * k_steps // shares - k_steps)
        return t, k0, k1, j - (1 - split)

    @gluon.jit
    def _load_partition(x_ptr, order_ptr, map_ptr, w_desc, a_bufs, b_bufs, ready, empty, hidden, inter,
                        TOPK: gl.constexpr, STAGES: gl.constexpr,
                        LOAD_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        # 16 bytes per thread along a row, the warps stacked over the rows
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [LOAD_WARPS, 1], [1, 0])
        n_col = inter // BN
        k_steps = hidden // BK
        w_bytes: gl.constexpr = 2 * BN * BK * 2
        ks = gl.arange(0, BK, layout=gl.SliceLayout(0, lay))
        whole, shares, n_units = _plan(map_ptr, n_col, k_steps, SPLIT)
        c = 0  # K steps issued, over every tile: the ring slot and its phase
        for v in range(gl.program_id(0), n_units, gl.num_programs(0)):
            t, k0, k1, _ = _unit(v, whole, shares, k_steps)
            e, row0, end_row, pid_n = _tile(t, map_ptr, n_col)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, lay))
            live = rows < end_row
            tokens = (gl.load(order_ptr + rows, mask=live, other=0) // TOPK).to(gl.int64)
            a_ptrs = x_ptr + tokens[:, None] * hidden + ks[None, :]
            a_mask = live[:, None] & (ks < BK)[None, :]
            g_row = e * 2 * inter + pid_n * BN
            for ki in range(k0, k1):
                s = c % STAGES
                # a fresh barrier counts as having completed the phase before its first
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                b = b_bufs.index(s)  # the gate rows, then the up rows
                mbarrier.expect(bar, w_bytes)
                tma.async_copy_global_to_shared(w_desc, [g_row, ki * BK], bar, b.slice(0, BN))
                tma.async_copy_global_to_shared(w_desc, [g_row + inter, ki * BK], bar, b.slice(BN, BN))
                async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + ki * BK, mask=a_mask)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                c += 1

    @gluon.jit
    def _mma_partition(map_ptr, act_ptr, part_ptr, count_ptr, a_bufs, b_bufs, ready, empty, hidden, inter,
                       STAGES: gl.constexpr, SPLIT: gl.constexpr,
                       num_warps: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = b_bufs.type.shape[1] // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 2 * BN, 16])
        tpw_n: gl.constexpr = BN // 8
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])
        n_col = inter // BN
        k_steps = hidden // BK
        whole, shares, n_units = _plan(map_ptr, n_col, k_steps, SPLIT)
        c = 0
        for v in range(gl.program_id(0), n_units, gl.num_programs(0)):
            t, k0, k1, slot = _unit(v, whole, shares, k_steps)
            e, row0, end_row, pid_n = _tile(t, map_ptr, n_col)
            acc = gl.zeros([BM, 2 * BN], gl.float32, layout=acc_layout)
            for ki in range(k0, k1):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                # the rows came through async copies (the generic proxy): order them before the
                # MMA's reads (the async proxy)
                fence_async_shared()
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # the previous step's MMA is done (in every warpgroup: the barrier), so its slot is free
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=ki > k0)
                c += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            if SPLIT > 1 and slot >= 0:  # (SPLIT: no split epilogue compiled in the unsplit kernel)
                _split_epilogue(acc, act_ptr, part_ptr, count_ptr, slot, shares, row0, end_row, pid_n, inter,
                                acc_layout, BM, BN, num_warps)
            else:
                _store_tile(acc, act_ptr, row0, end_row, pid_n, inter, out_layout, BM, BN)

    @gluon.jit
    def _store_tile(acc, act_ptr, row0, end_row, pid_n, inter, out_layout: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr):
        # silu(gate) * up of a whole tile, stored below the expert's end row
        acc_g, acc_u = acc.reshape([BM, 2, BN]).permute((0, 2, 1)).split()
        act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
        val = gl.convert_layout(act.to(act_ptr.dtype.element_ty), out_layout)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        gl.store(act_ptr + rows.to(gl.int64)[:, None] * inter + cols[None, :], val,
                 mask=(rows < end_row)[:, None] & (cols < inter)[None, :])

    @gluon.jit
    def _split_epilogue(acc, act_ptr, part_ptr, count_ptr, slot, shares, row0, end_row, pid_n, inter,
                        acc_layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        num_warps: gl.constexpr):
        # one share of a split tile: its float32 partial [BM, 2 * BN] to part_ptr's slot; the
        # share that counts itself in last (one atomic, nobody waits) adds the tile's partials in
        # share order (the same sum whoever is last: run to run the same bits) and stores the tile
        r = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        k = gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, acc_layout))
        gl.store(part_ptr + slot.to(gl.int64) * (BM * 2 * BN) + r[:, None] * (2 * BN) + k[None, :], acc)
        gl.thread_barrier()
        tile = slot // shares
        if gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == shares - 1:
            dtype: gl.constexpr = act_ptr.dtype.element_ty
            CH: gl.constexpr = 32
            lay: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (CH // 4), CH // 4], [num_warps, 1], [1, 0])
            rows = gl.arange(0, BM, layout=gl.SliceLayout(1, lay))
            ch = gl.arange(0, CH, layout=gl.SliceLayout(0, lay))
            base = (part_ptr + (tile * shares).to(gl.int64) * (BM * 2 * BN) + rows[:, None] * (2 * BN)
                    + ch[None, :])
            live = (row0 + rows) < end_row
            for c0 in gl.static_range(0, BN, CH):
                g = gl.zeros([BM, CH], gl.float32, layout=lay)
                u = gl.zeros([BM, CH], gl.float32, layout=lay)
                for s in range(shares):
                    g += gl.load(base + s * (BM * 2 * BN) + c0, cache_modifier=".cg")
                    u += gl.load(base + s * (BM * 2 * BN) + BN + c0, cache_modifier=".cg")
                act = g / (1.0 + gl.exp(-g)) * u
                cols = pid_n * BN + c0 + ch
                gl.store(act_ptr + (row0 + rows).to(gl.int64)[:, None] * inter + cols[None, :], act.to(dtype),
                         mask=live[:, None] & (cols < inter)[None, :])

    @gluon.jit
    def gate_up_ws_kernel(x_ptr, order_ptr, map_ptr, w_desc, act_ptr, part_ptr, count_ptr, hidden, inter,
                          TOPK: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                          LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, SPLIT: gl.constexpr,
                          num_warps: gl.constexpr):
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
        dtype: gl.constexpr = w_desc.dtype
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # the loader's threads' async copies (noinc arrivals) and the TMA's expect
            mbarrier.init(ready.index(i), count=LOAD_WARPS * 32 + 1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_mma_partition, (map_ptr, act_ptr, part_ptr, count_ptr, a_bufs, b_bufs, ready, empty, hidden,
                              inter, STAGES, SPLIT, num_warps)),
            (_load_partition, (x_ptr, order_ptr, map_ptr, w_desc, a_bufs, b_bufs, ready, empty, hidden, inter,
                               TOPK, STAGES, LOAD_WARPS, SPLIT)),
        ], [LOAD_WARPS], [LOAD_REGS])


def available(x: torch.Tensor, w1: torch.Tensor, block_n: int) -> bool:
    """Whether :func:`launch_gate_up_ws` takes these operands (see the module docstring); that
    the device is a Hopper GPU is the caller's check (it keeps the device's properties)."""
    if gluon is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w1.dtype != x.dtype or x.shape[1] % 64 or (w1.shape[1] // 2) % block_n:
        return False
    return not (x.data_ptr() % 16 or w1.data_ptr() % 16) and x.is_contiguous() and w1.is_contiguous()


def launch_gate_up_ws(x: torch.Tensor, order: torch.Tensor, tiles: torch.Tensor, w1: torch.Tensor,
                      act: torch.Tensor, topk: int, programs: int, *, block_m: int = 128, block_n: int = 128,
                      block_k: int = 64, stages: int = 4, load_warps: int = 4,
                      load_regs: int = 64, split: int = 0, counts: torch.Tensor | None = None) -> None:
    """The gate/up GEMM into ``act`` over the row tiles of :func:`dbo.experts.kernels.fused_maps.tile_map`
    (``tiles``, built with ``block_m``; its groups set the tiles' order), with ``programs``
    persistent programs (one per SM at most: each takes a whole SM's shared memory). ``block_m``
    is 64 or 128 (one warpgroup per 64 rows). ``split`` >= 2: the last round's tiles split along
    K into up to that many shares (see the module docstring; a float32 workspace of ``programs``
    partial tiles, and ``counts``: at least ``programs`` zeroed int32 counters, allocated here if
    not given)."""
    if block_m not in (64, 128):
        raise ValueError(f"block_m must be 64 or 128, got {block_m}")
    n_experts, two_inter, hidden = w1.shape
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    w = Desc(w1.view(n_experts * two_inter, hidden), (block_n, block_k),
             gl.NVMMASharedLayout.get_default_for([block_n, block_k], dt))
    warps = block_m // 16
    # the registers at launch: the kernel's warps (rounded to warpgroups) share the SM's 64K;
    # the partitions then move them (the loader keeps load_regs, the MMA warps take the rest)
    maxnreg = 65536 // (32 * cdiv(warps + load_warps, 4) * 4) // 8 * 8
    programs = max(1, programs)
    part, count = act, tiles  # (not read without a split)
    if split > 1:
        # at most `programs` split units: a partial each, and a count per split tile
        part = torch.empty(programs * block_m * 2 * block_n, dtype=torch.float32, device=x.device)
        if counts is None:
            count = torch.zeros(programs, dtype=torch.int32, device=x.device)
        elif counts.dtype != torch.int32 or counts.numel() < programs or counts.device != x.device:
            raise ValueError(f"counts must be >= {programs} int32 counters on {x.device}, got "
                             f"{counts.numel()} {counts.dtype} on {counts.device}")
        else:
            count = counts
    launch(gate_up_ws_kernel, (programs,), (x, order, tiles, w, act, part, count, hidden, two_inter // 2),
           dict(TOPK=topk, BM=block_m, STAGES=stages, LOAD_WARPS=load_warps,
                LOAD_REGS=load_regs, SPLIT=max(1, split), num_warps=warps, maxnreg=maxnreg))
