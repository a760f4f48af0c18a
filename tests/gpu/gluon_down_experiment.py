"""An experiment, not part of the library: the down GEMM of the fused experts for short K
(I <= 256) on Hopper, written in Gluon (Triton 3.6's explicit-layout language).

Measured on an H200 (``tests/gpu/probe_gluon_down.py``, docs/perf_notes.md section 5g): the
same output as the library's Triton tile, bit for bit, and 1.00-1.30x its time on nine I=256
shapes, 0.94x on the largest: the library does not use it. Kept so that the next attempt starts
from a working kernel (the profile of where its steps wait is the next thing to take).

At I=256 the down GEMM reads a ``[128, 256]`` activation tile and a ``[BN, 256]`` weight tile
per output tile and writes ``[128, BN]``: with K this short, Triton's kernels
(:func:`dbo.moe.fused_kernels.down_flat_kernel`) spend as long loading the activation tile again
for every column block and storing each tile as computing it, and Nsight Compute finds neither
the tensor pipe (50%) nor L2 (54%) nor DRAM (42%) busy (H200, 256 local experts, T=16384).
This kernel keeps the activation tile in shared memory while it walks ``NPP`` column blocks
(only the weight tiles stream, through a ring of ``STAGES`` TMA buffers: twice the flops per
byte read from L2), and stores each tile's output while the tensor cores compute the next one
(``warpgroup_mma`` is asynchronous: the store of block ``j - 1`` is issued between the MMAs of
block ``j`` and the wait for them).

Each program walks every num_programs-th work item: (expert, row tile of ``BM`` rows, group of
``NPP`` column blocks), in the order of :func:`dbo.moe.fused_kernels` (``_tile_table``): rows
past an expert's end are computed (the next expert's rows, or TMA's zeros) and never stored.

It runs where :func:`available` says so (CUDA, compute capability 9.x, Triton with Gluon's
Hopper API, bf16/fp16, ``I % 64 == 0``, ``I <= 256``).
"""

from __future__ import annotations

import torch

__all__ = ["BM", "BN", "available", "launch_down_short_k", "groups_per_tile"]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon's Hopper API
    gluon = None

#: the output tile: rows x columns; K is walked in chunks of 64 (one 128-byte swizzled box)
BM, BN, BK = 128, 64, 64
#: weight-tile buffers in flight
STAGES = 3


if gluon is not None:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def down_short_k_wgmma_kernel(a_desc, w_desc, order_ptr, offs_ptr, y_ptr, n_experts, hidden,
                                  KC: gl.constexpr, NPP: gl.constexpr, BLOCK_E: gl.constexpr,
                                  STAGES: gl.constexpr, TWO_ACC: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = a_desc.dtype

        # the work table (as _tile_table): per expert its rows, row tiles and end in item order
        e_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        es = gl.arange(0, BLOCK_E, layout=e_layout)
        live = es < n_experts
        ends = gl.load(offs_ptr + es, mask=live, other=0)
        starts = gl.load(offs_ptr + es - 1, mask=live & (es > 0), other=0)
        m_tiles = gl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        n_col = (hidden + BLOCK_N - 1) // BLOCK_N
        n_groups = (n_col + NPP - 1) // NPP
        item_ends = gl.where(live, gl.associative_scan(m_tiles, 0, _add) * n_groups, 2147483647)
        n_items = gl.sum(m_tiles, 0) * n_groups

        a_smem = gl.allocate_shared_memory(dtype, [KC, BLOCK_M, BLOCK_K], a_desc.layout)
        w_smem = gl.allocate_shared_memory(dtype, [STAGES * KC, BLOCK_N, BLOCK_K], w_desc.layout)
        a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(a_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(w_bar.index(i), count=1)

        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        # stores: 8 contiguous elements (16 bytes) per thread along a row
        tpw_n: gl.constexpr = BLOCK_N // 8
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, out_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, out_layout)
        w_bytes: gl.constexpr = KC * BLOCK_N * BLOCK_K * 2
        a_bytes: gl.constexpr = KC * BLOCK_M * BLOCK_K * 2

        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        loads = 0  # weight tiles requested (over all items): ring slot loads % STAGES
        uses = 0   # weight tiles consumed
        it = 0  # items done: the activation barrier's phase
        for item in range(pid, n_items, n_prog):
            # item -> expert, first row, the expert's end row, first column block
            e = gl.sum((item_ends <= item).to(gl.int32), 0)
            sel = es == e
            first_item = gl.sum(gl.where(sel, item_ends - m_tiles * n_groups, 0), 0)
            row0 = gl.sum(gl.where(sel, starts, 0), 0)
            end_row = gl.sum(gl.where(sel, ends, 0), 0)
            local = item - first_item
            row0 = row0 + (local // n_groups) * BLOCK_M
            col_block0 = (local % n_groups) * NPP
            w_row0 = e * hidden + col_block0 * BLOCK_N

            # the activation tile (the previous item's MMAs have completed: each was waited)
            mbarrier.expect(a_bar, a_bytes)
            for kc in gl.static_range(KC):
                tma.async_copy_global_to_shared(a_desc, [row0, kc * BLOCK_K], a_bar, a_smem.index(kc))
            # the first weight tiles: STAGES of them with two accumulators (a slot is reloaded
            # once the MMAs of the step before are done), else STAGES - 1
            for p in gl.static_range(STAGES if TWO_ACC else STAGES - 1):
                if p < NPP:
                    s = loads % STAGES
                    mbarrier.expect(w_bar.index(s), w_bytes)
                    for kc in gl.static_range(KC):
                        tma.async_copy_global_to_shared(w_desc, [w_row0 + p * BLOCK_N, kc * BLOCK_K],
                                                        w_bar.index(s), w_smem.index(s * KC + kc))
                    loads += 1
            rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
            row_mask = rows < end_row
            slots = gl.load(order_ptr + rows, mask=row_mask, other=0).to(gl.int64)
            y_rows = y_ptr + slots[:, None] * hidden
            mbarrier.wait(a_bar, phase=it & 1)

            if TWO_ACC:
                # step j: MMAs of block j issued; those of block j - 1 waited for (KC groups may
                # stay in flight: block j's); block j - 1's slot reloaded and its output stored
                # while the tensor cores compute block j
                zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
                acc_prev = warpgroup_mma_init(zero)
                for j in range(NPP):
                    s = uses % STAGES
                    mbarrier.wait(w_bar.index(s), phase=(uses // STAGES) & 1)
                    acc = warpgroup_mma(a_smem.index(0), w_smem.index(s * KC).permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                    for kc in gl.static_range(1, KC):
                        acc = warpgroup_mma(a_smem.index(kc), w_smem.index(s * KC + kc).permute((1, 0)), acc,
                                            is_async=True)
                    done = warpgroup_mma_wait(num_outstanding=KC, deps=(acc_prev,))
                    if (j > 0) & (j - 1 + STAGES < NPP):
                        r = loads % STAGES
                        mbarrier.expect(w_bar.index(r), w_bytes)
                        for kc in gl.static_range(KC):
                            tma.async_copy_global_to_shared(
                                w_desc, [w_row0 + (j - 1 + STAGES) * BLOCK_N, kc * BLOCK_K], w_bar.index(r),
                                w_smem.index(r * KC + kc))
                        loads += 1
                    cols = (col_block0 + j - 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                    gl.store(y_rows + cols[None, :], gl.convert_layout(done.to(dtype), out_layout),
                             mask=row_mask[:, None] & ((cols < hidden) & (j > 0))[None, :])
                    acc_prev = acc
                    uses += 1
                done = warpgroup_mma_wait(num_outstanding=0, deps=(acc_prev,))
                prev = gl.convert_layout(done.to(dtype), out_layout)
            else:
                prev = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=out_layout)
                for j in range(NPP):
                    if j + STAGES - 1 < NPP:  # the slot of step j - 1, whose MMAs were waited
                        s = loads % STAGES
                        mbarrier.expect(w_bar.index(s), w_bytes)
                        for kc in gl.static_range(KC):
                            tma.async_copy_global_to_shared(
                                w_desc, [w_row0 + (j + STAGES - 1) * BLOCK_N, kc * BLOCK_K], w_bar.index(s),
                                w_smem.index(s * KC + kc))
                        loads += 1
                    s = uses % STAGES
                    mbarrier.wait(w_bar.index(s), phase=(uses // STAGES) & 1)
                    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
                    for kc in gl.static_range(KC):
                        acc = warpgroup_mma(a_smem.index(kc), w_smem.index(s * KC + kc).permute((1, 0)), acc,
                                            is_async=True)
                    # block j - 1's output, while the tensor cores compute block j
                    cols = (col_block0 + j - 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                    gl.store(y_rows + cols[None, :], prev,
                             mask=row_mask[:, None] & ((cols < hidden) & (j > 0))[None, :])
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    uses += 1
                    prev = gl.convert_layout(acc.to(dtype), out_layout)
            cols = (col_block0 + NPP - 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            gl.store(y_rows + cols[None, :], prev, mask=row_mask[:, None] & (cols < hidden)[None, :])
            it += 1  # noqa: SIM113 (a Gluon loop: no enumerate)

        mbarrier.invalidate(a_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(w_bar.index(i))


_SMS: dict[torch.device, int] = {}


def available(act: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether :func:`launch_down_short_k` runs here (see the module docstring)."""
    if gluon is None or not act.is_cuda or act.dtype not in (torch.bfloat16, torch.float16):
        return False
    inter = w2.shape[2]
    if inter % BK or inter > 256 or w2.dtype != act.dtype:
        return False
    if torch.cuda.get_device_capability(act.device)[0] != 9:
        return False
    return act.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0 and act.is_contiguous() and w2.is_contiguous()


def groups_per_tile(rows_per_expert: float, n_experts: int, hidden: int, sms: int) -> int:
    """Column blocks per work item: the most (a power of two, down to 8) that still give every
    SM about four items for the estimated row tiles; fewer blocks per item reload the
    activation tile more often, more leave SMs idle."""
    n_col = -(-hidden // BN)
    tiles = n_experts * max(1, -(-int(rows_per_expert) // BM))
    npp = 1 << max(3, (n_col - 1).bit_length())
    while npp > 8 and tiles * -(-n_col // npp) < 4 * sms:
        npp //= 2
    return npp


def launch_down_short_k(act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w2: torch.Tensor,
                        y: torch.Tensor, pairs: int, rows_per_expert: float, num_warps: int = 4,
                        npp: int | None = None, two_acc: bool = True, stages: int = STAGES) -> None:
    """``y[order[r]] = act[r] @ w2[e].T`` for each sorted row ``r`` of expert ``e`` (the local
    pairs' rows; ``pairs`` bounds them: the grid). ``npp``: column blocks per work item
    (default :func:`groups_per_tile`)."""
    n_experts, hidden, inter = w2.shape
    dev = act.device
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    if npp is None:
        npp = groups_per_tile(rows_per_expert, n_experts, hidden, _SMS[dev])
    dt = gl.bfloat16 if act.dtype == torch.bfloat16 else gl.float16
    a_desc = TensorDescriptor.from_tensor(act, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], dt))
    w_desc = TensorDescriptor.from_tensor(w2.view(n_experts * hidden, inter), [BN, BK],
                                          gl.NVMMASharedLayout.get_default_for([BN, BK], dt))
    n_col = -(-hidden // BN)
    items = (-(-pairs // BM) + n_experts) * -(-n_col // npp)
    grid = (max(1, min(items, _SMS[dev])),)
    down_short_k_wgmma_kernel[grid](a_desc, w_desc, order, offsets, y, n_experts, hidden, KC=inter // BK,
                                    NPP=npp, BLOCK_E=max(16, 1 << (n_experts - 1).bit_length()),
                                    STAGES=stages, TWO_ACC=two_acc, num_warps=num_warps)
