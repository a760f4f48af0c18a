"""The fused experts' tiles: which tile each grouped GEMM of :mod:`dbo.moe.fused_experts` runs
with, by rows per expert and intermediate size, and when the fused kernels beat the unfused steps.

The table comes from tile sweeps on an H200 (``tests/gpu/tune_experts.py``: each GEMM alone,
against its own hardware limit; docs/perf_notes.md section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GemmConfig", "CONFIGS", "FP32_CONFIG", "DOWN_LONG_K", "FUSED_MAX_ROWS_PER_EXPERT",
           "prefer_fused", "pick_configs"]


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tile: ``block_m`` rows x ``block_n`` columns, ``block_k`` deep;
    ``group_m`` row blocks share a column block in launch order; Triton's warps and stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    #: down only, intermediate <= block_k: column blocks per program (0: the K-loop kernel)
    n_per_program: int = 0
    #: load the weight tiles (and the down GEMM's activation tiles) with the Hopper tensor
    #: memory accelerator (a host-side TMA descriptor) instead of per-thread async copies
    tma: bool = False


#: 4-byte inputs (float32: tests, references) take this small tile: shared memory holds twice
#: the bytes per element, and speed does not matter there
FP32_CONFIG = GemmConfig(64, 64, 32, 8, 4, 2)


#: (largest estimated rows per expert, gate_up tile, down tile, down tile when I <= 256), first
#: match wins. From the tile sweeps on an H200 (tests/gpu/tune_experts.py, docs/perf_notes.md).
CONFIGS: tuple[tuple[int, GemmConfig, GemmConfig, GemmConfig], ...] = (
    (48, GemmConfig(64, 64, 64, 8, 4, 4, tma=True), GemmConfig(64, 128, 64, 8, 4, 4, tma=True),
     GemmConfig(64, 128, 256, 8, 4, 2, n_per_program=8)),
    (96, GemmConfig(128, 128, 64, 8, 8, 4, tma=True), GemmConfig(128, 256, 64, 8, 8, 4),
     GemmConfig(128, 64, 256, 8, 4, 3, n_per_program=16)),
    (192, GemmConfig(128, 128, 64, 8, 8, 4, tma=True), GemmConfig(128, 256, 64, 8, 8, 4, tma=True),
     GemmConfig(128, 64, 256, 8, 4, 3, n_per_program=16)),
    (1 << 62, GemmConfig(128, 128, 64, 8, 8, 3, tma=True), GemmConfig(128, 256, 64, 8, 8, 4, tma=True),
     GemmConfig(128, 64, 256, 8, 4, 3, n_per_program=16)),
)

#: above this many estimated rows per expert, with I > 1024, the unfused steps (CUTLASS's
#: grouped GEMM through ``torch._grouped_mm``) beat the fused Triton kernels on an H200 (by ~5%
#: at I=2048 and 2048 rows); below it, and at any size for I <= 1024, the fused kernels are as
#: fast or faster with TMA tiles and launch fewer kernels (host time counts double under DBO)
FUSED_MAX_ROWS_PER_EXPERT = 768


#: the down tile for I >= 2048 between 96 and 384 rows per expert (the last sweep: 2.85 against
#: 2.94 ms at 128 rows, 4.50 against 4.77 ms at 256, I=2048 and 256 experts)
DOWN_LONG_K = GemmConfig(128, 128, 64, 8, 4, 5, tma=True)


def prefer_fused(rows_per_expert: float, intermediate: int) -> bool:
    """Whether the fused kernels are expected to beat the unfused steps at this size."""
    return intermediate <= 1024 or rows_per_expert <= FUSED_MAX_ROWS_PER_EXPERT


def pick_configs(rows_per_expert: float, intermediate: int = 1 << 30) -> tuple[GemmConfig, GemmConfig]:
    """The ``(gate_up, down)`` tiles for an estimated number of rows per local expert."""
    for bound, up, down, down_short in CONFIGS:
        if rows_per_expert <= bound:
            if intermediate <= 256:
                down = down_short
            elif intermediate >= 2048 and 96 < rows_per_expert <= 384:
                down = DOWN_LONG_K
            return up, down
    raise AssertionError("the last CONFIGS bound covers every size")
