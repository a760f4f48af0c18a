"""The fused experts' gate/up GEMM as a warp-specialized Hopper kernel, written in Gluon
(Triton's explicit-layout language), for :func:`dbo.moe.fused_experts.launch_gate_up` where the
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
under this tile's epilogue). The row tiles come from :func:`dbo.moe.fused_experts.tile_map`
(``BM`` rows of one expert; the flat down kernel reads the same map); tile ``t`` is row tile
``pid_m`` of column block ``pid_n``, ``GROUP_M`` row tiles per column block in tile order.

On an H200 (``tests/gpu/probe_gate_up_ws.py``, docs/perf_notes.md section 5m) the 128-row tile
took 0.90-0.95x the Triton tile's time from ~512 rows per expert and 1.08-1.18x at 128-256 rows
per expert with few experts (fewer, larger tiles fill the last wave worse).

It runs on a Hopper GPU where :func:`available` says so (Triton with Gluon's Hopper API,
bf16/fp16, ``hidden % 64 == 0``, ``I % BN == 0``, 16-byte aligned contiguous operands);
elsewhere the caller takes the Triton kernel (:func:`dbo.moe.fused_experts.runs_ws`).
"""

from __future__ import annotations

import torch

from dbo.moe.triton_launch import Desc, cdiv, launch

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
    def _load_partition(x_ptr, order_ptr, map_ptr, w_desc, a_bufs, b_bufs, ready, empty, hidden, inter,
                        TOPK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                        LOAD_WARPS: gl.constexpr):
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
        c = 0  # K steps issued, over every tile: the ring slot and its phase
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
    def _mma_partition(map_ptr, act_ptr, a_bufs, b_bufs, ready, empty, hidden, inter, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = b_bufs.type.shape[1] // 2
        dtype: gl.constexpr = a_bufs.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 2 * BN, 16])
        tpw_n: gl.constexpr = BN // 8
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])
        n_m = gl.load(map_ptr)
        n_col = inter // BN
        k_steps = hidden // BK
        c = 0
        for t in range(gl.program_id(0), n_m * n_col, gl.num_programs(0)):
            e, row0, end_row, pid_n = _tile(t, map_ptr, n_m, n_col, GROUP_M)
            acc = gl.zeros([BM, 2 * BN], gl.float32, layout=acc_layout)
            for ki in range(k_steps):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                # the rows came through async copies (the generic proxy): order them before the
                # MMA's reads (the async proxy)
                fence_async_shared()
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # the previous step's MMA is done (in every warpgroup: the barrier), so its slot is free
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=ki > 0)
                c += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            acc_g, acc_u = acc.reshape([BM, 2, BN]).permute((0, 2, 1)).split()
            act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
            val = gl.convert_layout(act.to(dtype), out_layout)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            gl.store(act_ptr + rows.to(gl.int64)[:, None] * inter + cols[None, :], val,
                     mask=(rows < end_row)[:, None] & (cols < inter)[None, :])

    @gluon.jit
    def gate_up_ws_kernel(x_ptr, order_ptr, map_ptr, w_desc, act_ptr, hidden, inter, TOPK: gl.constexpr,
                          BM: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
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
            (_mma_partition, (map_ptr, act_ptr, a_bufs, b_bufs, ready, empty, hidden, inter, GROUP_M, STAGES,
                              num_warps)),
            (_load_partition, (x_ptr, order_ptr, map_ptr, w_desc, a_bufs, b_bufs, ready, empty, hidden, inter,
                               TOPK, GROUP_M, STAGES, LOAD_WARPS)),
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
                      block_k: int = 64, stages: int = 4, group_m: int = 8, load_warps: int = 4,
                      load_regs: int = 64) -> None:
    """The gate/up GEMM into ``act`` over the row tiles of :func:`dbo.moe.fused_experts.tile_map`
    (``tiles``, built with ``block_m``), with ``programs`` persistent programs (one per SM at
    most: each takes a whole SM's shared memory). ``block_m`` is 64 or 128 (one warpgroup per
    64 rows)."""
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
    launch(gate_up_ws_kernel, (max(1, programs),), (x, order, tiles, w, act, hidden, two_inter // 2),
           dict(TOPK=topk, BM=block_m, GROUP_M=group_m, STAGES=stages, LOAD_WARPS=load_warps,
                LOAD_REGS=load_regs, num_warps=warps, maxnreg=maxnreg))
