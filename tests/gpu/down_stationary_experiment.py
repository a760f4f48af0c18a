"""A weight-stationary down GEMM for short K (intermediate <= 256), an experiment beside the flat
down kernel (``dbo.moe.fused_kernels.down_flat_kernel``).

The flat kernel's 128x128 tile at K=256 reads a 64 KB weight tile and a 64 KB rows' tile from L2
for 8.4 MFLOP (64 flop/byte): at I=256 it sits at ~55% of the GEMM rate (docs/dev_notes.md,
twelfth session). Here a program owns one (expert, column block): it loads the ``[BLOCK_N, K]``
weight tile once and walks the expert's row tiles, so per row tile only the rows' tile moves
(``BLOCK_N`` flop/byte: 128 or 256), and each weight byte leaves memory once. Same epilogue as the
flat kernel (``SOLE`` included), same numbers (one K step of K per tile: the dot's K order is the
flat kernel's at BLOCK_K = K... not necessarily; the probe compares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dbo.moe.fused_kernels import down_store
from dbo.moe.triton_launch import Desc, cdiv, launch


@triton.jit
def down_stationary_kernel(act_desc, order_ptr, offs_ptr, w_desc, y_ptr, tw_ptr, out_ptr, n_experts, hidden,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr,
                           SOLE: tl.constexpr, STAGES: tl.constexpr):
    n_col = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // n_col
    pid_n = pid % n_col
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    if end > start:
        b = w_desc.load([e * hidden + pid_n * BLOCK_N, 0])
        for row0 in tl.range(start, end, BLOCK_M, num_stages=STAGES):
            a = act_desc.load([row0, 0])
            acc = tl.dot(a, b.T)
            down_store(acc, row0, end, pid_n, order_ptr, y_ptr, tw_ptr, out_ptr, hidden, BLOCK_M, BLOCK_N,
                       TOPK, SOLE)


def launch_down_stationary(act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w2: torch.Tensor,
                           y: torch.Tensor, *, block_m: int = 64, block_n: int = 128, num_warps: int = 4,
                           stages: int = 2, sole: tuple | None = None, dest: torch.Tensor | None = None):
    """``y[order[r]] = act[r] @ d_e.T`` (``sole=(ids, weights, out)`` with ``dest`` from
    ``tile_map(..., sole=...)``: as the flat kernel)."""
    n_experts, hidden, inter = w2.shape
    a = Desc(act, (block_m, inter))
    w = Desc(w2.view(n_experts * hidden, inter), (block_n, inter))
    tw, out, topk = (sole[1], sole[2], sole[0].shape[1]) if sole is not None else (order, y, 1)
    launch(down_stationary_kernel, (n_experts * cdiv(hidden, block_n),), (
        a, order if dest is None else dest, offsets, w, y, tw, out, n_experts, hidden), dict(
        BLOCK_M=block_m, BLOCK_N=block_n, K=inter, TOPK=topk, SOLE=sole is not None, STAGES=stages,
        num_warps=num_warps, num_stages=stages))
