"""An experiment, not (yet) part of the library: the fused experts' gate/up GEMM as a
warp-specialized Hopper kernel, written in Gluon (Triton 3.6's explicit-layout language).

``act[r] = silu(x[t] @ g_e.T) * (x[t] @ u_e.T)`` for each sorted row ``r`` of expert ``e``
(``t = order[r] // topk``), as :func:`dbo.moe.fused_experts.launch_gate_up` computes it.

The library's Triton kernel has one warpgroup per program both gather the rows (per-thread async
copies) and issue the MMAs, on a 64-row tile. Here the work is split between partitions of one
persistent program per SM:

* a loader (``LOAD_WARPS`` warps): per K step it waits for a free ring slot, issues the TMA
  copies of the gate and up weight tiles (one thread) and each thread's async copies of the
  gathered ``x`` rows, whose completion arrives on the slot's barrier (``cp.async.mbarrier.arrive
  .noinc``: the barrier counts the loader's threads plus the TMA's arrival);
* the MMA partition (the default, ``num_warps`` warps: one warpgroup per 64 rows): per K step
  it waits for the slot, issues the gate and up ``warpgroup_mma`` asynchronously, waits for the
  previous step's and releases that slot; per tile it applies ``silu(gate) * up`` and stores
  the rows below the expert's end.

So the loads run ahead by up to ``STAGES`` K steps across tile boundaries (the next tile's
loads go on under this tile's epilogue), and a 128-row tile reads each weight tile once for
twice the rows of the library's 64-row tile, with no warps of its own stalled on addresses.

The row tiles come from :func:`dbo.moe.fused_experts.tile_map` (``BM`` rows of one expert, no
tail tiles: rows past the expert's end are gathered as zeros, computed and never stored). Tile
``t`` is row tile ``pid_m`` of column block ``pid_n``, ``GROUP_M`` row tiles per column block in
tile order, as the library's kernels order them.

It runs where :func:`available` says so (CUDA, compute capability 9.x, Triton with Gluon's
Hopper API, bf16/fp16, ``hidden % 64 == 0``, ``I % BN == 0``).
"""

from __future__ import annotations

import torch

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon's Hopper API
    gluon = None


if gluon is not None:

    @gluon.jit
    def _tile(t, map_ptr, n_m, n_col, GROUP_M: gl.constexpr):
        # tile t -> (expert, first row, the expert's end row, column block): GROUP_M row tiles
        # share a column block in tile order
        group = GROUP_M * n_col
        first_m = (t // group) * GROUP_M
        size_m = gl.maximum(gl.minimum(n_m - first_m, GROUP_M), 1)
        pid_m = first_m + (t % group) % size_m
        pid_n = (t % group) // size_m
        e = gl.load(map_ptr + 1 + 3 * pid_m)
        row0 = gl.load(map_ptr + 2 + 3 * pid_m)
        end_row = gl.load(map_ptr + 3 + 3 * pid_m)
        return e, row0, end_row, pid_n

    @gluon.jit
    def _load_partition(x_ptr, order_ptr, map_ptr, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, hidden,
                        inter, TOPK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                        LOAD_WARPS: gl.constexpr, FUSED_N: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        # 16 bytes per thread along a row, the warps stacked over the rows
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [LOAD_WARPS, 1], [1, 0])
        n_m = gl.load(map_ptr)
        n_col = inter // BN
        k_steps = hidden // BK
        w_bytes: gl.constexpr = 2 * BN * BK * 2
        ks = gl.arange(0, BK, layout=gl.SliceLayout(0, lay))
        c = 0
        for t in range(gl.program_id(0), n_m * n_col, gl.num_programs(0)):
            e, row0, end_row, pid_n = _tile(t, map_ptr, n_m, n_col, GROUP_M)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, lay))
            live = rows < end_row
            tokens = (gl.load(order_ptr + rows, mask=live, other=0) // TOPK).to(gl.int64)
            a_ptrs = x_ptr + tokens[:, None] * hidden + ks[None, :]
            a_mask = live[:, None] & (ks < BK)[None, :]
            g_row = e * 2 * inter + pid_n * BN
            for ki in range(k_steps):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, w_bytes)
                if FUSED_N:  # g_bufs: [STAGES, 2 * BN, BK], the gate rows then the up rows
                    b = g_bufs.index(s)
                    tma.async_copy_global_to_shared(w_desc, [g_row, ki * BK], bar, b.slice(0, BN))
                    tma.async_copy_global_to_shared(w_desc, [g_row + inter, ki * BK], bar, b.slice(BN, BN))
                else:
                    tma.async_copy_global_to_shared(w_desc, [g_row, ki * BK], bar, g_bufs.index(s))
                    tma.async_copy_global_to_shared(w_desc, [g_row + inter, ki * BK], bar, u_bufs.index(s))
                async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + ki * BK, mask=a_mask)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                c += 1

    @gluon.jit
    def _mma_partition(map_ptr, act_ptr, a_bufs, g_bufs, u_bufs, ready, empty, hidden, inter,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, FUSED_N: gl.constexpr,
                       num_warps: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = u_bufs.type.shape[1]
        dtype: gl.constexpr = a_bufs.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        # FUSED_N: one MMA of 2 * BN columns (the gate and the up tile side by side in shared memory)
        # reads the rows' tile once per K step instead of twice
        acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, 2 * BN, 16])
        tpw_n: gl.constexpr = BN // 8
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])
        n_m = gl.load(map_ptr)
        n_col = inter // BN
        k_steps = hidden // BK
        c = 0
        for t in range(gl.program_id(0), n_m * n_col, gl.num_programs(0)):
            e, row0, end_row, pid_n = _tile(t, map_ptr, n_m, n_col, GROUP_M)
            if FUSED_N:
                acc = gl.zeros([BM, 2 * BN], gl.float32, layout=acc2_layout)
                for ki in range(k_steps):
                    s = c % STAGES
                    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                    fence_async_shared()
                    acc = warpgroup_mma(a_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=ki > 0)
                    c += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc_g, acc_u = acc.reshape([BM, 2, BN]).permute((0, 2, 1)).split()
            else:
                acc_g = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
                acc_u = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
                for ki in range(k_steps):
                    s = c % STAGES
                    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                    # the rows came through async copies (the generic proxy): order them before the
                    # MMAs' reads (the async proxy)
                    fence_async_shared()
                    a = a_bufs.index(s)
                    acc_g = warpgroup_mma(a, g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                    acc_u = warpgroup_mma(a, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                    # the previous step's MMAs are done (both warpgroups: the barrier): its slot is free
                    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=ki > 0)
                    c += 1
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            gl.thread_barrier()
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
            val = gl.convert_layout(act.to(dtype), out_layout)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            gl.store(act_ptr + rows.to(gl.int64)[:, None] * inter + cols[None, :], val,
                     mask=(rows < end_row)[:, None] & (cols < inter)[None, :])

    @gluon.jit
    def gate_up_ws_kernel(x_ptr, order_ptr, map_ptr, w_desc, act_ptr, hidden, inter, TOPK: gl.constexpr,
                          BM: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, FUSED_N: gl.constexpr,
                          num_warps: gl.constexpr):
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
        dtype: gl.constexpr = w_desc.dtype
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
        if FUSED_N:  # the gate and up tiles in one buffer; u_bufs only carries the tile's shape
            g_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BN, BK], w_desc.layout)
            u_bufs = gl.allocate_shared_memory(dtype, [1, BN, BK], w_desc.layout)
        else:
            g_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
            u_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # the loader's threads' async copies (noinc arrivals) and the TMA's expect
            mbarrier.init(ready.index(i), count=LOAD_WARPS * 32 + 1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_mma_partition, (map_ptr, act_ptr, a_bufs, g_bufs, u_bufs, ready, empty, hidden, inter, GROUP_M,
                              STAGES, FUSED_N, num_warps)),
            (_load_partition, (x_ptr, order_ptr, map_ptr, w_desc, a_bufs, g_bufs, u_bufs, ready, empty,
                               hidden, inter, TOPK, GROUP_M, STAGES, LOAD_WARPS, FUSED_N)),
        ], [LOAD_WARPS], [LOAD_REGS])


_SMS: dict[torch.device, int] = {}


def available(x: torch.Tensor, w1: torch.Tensor, bn: int = 128) -> bool:
    """Whether :func:`launch_gate_up_ws` runs here (see the module docstring)."""
    if gluon is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w1.dtype != x.dtype:
        return False
    hidden, inter = x.shape[1], w1.shape[1] // 2
    if hidden % 64 or inter % bn or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return x.data_ptr() % 16 == 0 and w1.data_ptr() % 16 == 0 and x.is_contiguous() and w1.is_contiguous()


def launch_gate_up_ws(x: torch.Tensor, order: torch.Tensor, tiles: torch.Tensor, w1: torch.Tensor,
                      act: torch.Tensor, topk: int, pairs: int, *, bm: int = 128, bn: int = 128, bk: int = 64,
                      stages: int = 4, group_m: int = 8, load_warps: int = 4, load_regs: int = 64,
                      maxnreg: int | None = None, programs: int | None = None, fused_n: bool = True) -> None:
    """The gate/up GEMM into ``act`` over the row tiles of :func:`dbo.moe.fused_experts.tile_map`
    (``tiles``, built with ``block_m=bm``); ``pairs`` bounds the local pairs (the grid)."""
    n_experts, two_inter, hidden = w1.shape
    inter = two_inter // 2
    dev = x.device
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    w_desc = TensorDescriptor.from_tensor(w1.view(n_experts * two_inter, hidden), [bn, bk],
                                          gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    n_tiles = (-(-pairs // bm) + n_experts) * (inter // bn)
    grid = (max(1, min(n_tiles, programs or _SMS[dev])),)
    warps = bm // 16  # one warpgroup per 64 rows
    total = warps + load_warps
    kw = {} if maxnreg is False else {"maxnreg": maxnreg or (65536 // (32 * -(-total // 4) * 4)) // 8 * 8}
    gate_up_ws_kernel[grid](x, order, tiles, w_desc, act, hidden, inter, TOPK=topk, BM=bm, GROUP_M=group_m,
                            STAGES=stages, LOAD_WARPS=load_warps, LOAD_REGS=load_regs, FUSED_N=fused_n,
                            num_warps=warps, **kw)
