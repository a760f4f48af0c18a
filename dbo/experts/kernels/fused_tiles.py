"""The fused experts' tiles: which tile each grouped GEMM of :mod:`dbo.experts.kernels.fused_experts` runs
with, by rows per expert and intermediate size, and when the fused kernels beat the unfused steps.

The table comes from tile sweeps on an H200 (``tools/probes/tune_experts.py``: each GEMM alone,
against its own hardware limit; docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GemmConfig", "CONFIGS", "FP32_CONFIG", "FEW_EXPERTS_UP", "FEW_EXPERTS_DOWN", "FLAT_DOWN",
           "FLAT_DOWN_WIDE", "FLAT_DOWN_64", "DOWN_TAIL", "WS_UP", "WS_UP64", "WS_UP64_SPLIT", "WS_UP_SPLIT",
           "FUSED_MAX_ROWS_PER_EXPERT",
           "FUSED_MAX_LOCAL_EXPERTS", "FUSED_MAX_INTERMEDIATE", "prefer_fused", "prefer_persistent",
           "prefer_sole", "SOLE_MIN_SHARE", "pick_configs", "pick_slab_configs"]


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tile: ``block_m`` rows x ``block_n`` columns, ``block_k`` deep;
    ``group_m`` row blocks share a column block in launch order (the flat down and the
    warp-specialized tiles: at most ``group_m``, the groups of their row-tile map, which never
    span two experts); Triton's warps and stages."""

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
    #: 0, or a power of two in [16, block_m): an expert's last tile whose rows fit in it runs as
    #: a ``tail_m``-row tile (else, when they fit in ``block_m // 2``, as a half tile), so the
    #: rows past the expert's end cost no flops (K-loop kernels only)
    tail_m: int = 0
    #: down only: the persistent kernel whose tile loop is flattened with its K loop (TMA loads,
    #: no tail tiles), so that the next tile's loads overlap this tile's products and stores
    flat: bool = False
    #: None: the call's policy (:func:`prefer_persistent`); True/False: this tile's programs walk
    #: the tiles (one per resident slot) or take one tile each (a tuned table's choice; the flat
    #: down tile is persistent always)
    persistent: bool | None = None
    #: gate/up only: the warp-specialized Gluon kernel (:mod:`dbo.experts.kernels.gluon_gate_up`: a loader
    #: partition and ``block_m // 64`` MMA warpgroups, one program per SM, ``num_stages`` slots;
    #: ``num_warps`` is not used) over the flat down kernel's row-tile map, where it runs
    #: (Hopper, bf16/fp16); elsewhere the Triton kernel with the same blocks and TMA
    ws: bool = False
    #: warp-specialized gate/up tiles only: 0, or the most shares (>= 2) into which each tile of
    #: the last round, the one that fewer tiles than programs fill, is split along K (float32
    #: partials; the last share to finish adds them in share order and stores the tile)
    split: int = 0
    #: warp-specialized tiles only: the Triton tile that runs where the Gluon kernel does not
    #: (another GPU than Hopper, misaligned operands); None: the same blocks (``triton_tile``)
    fallback: GemmConfig | None = None

    def __post_init__(self) -> None:
        t = self.tail_m  # tl.dot takes at least 16 rows
        if t and (t < 16 or t >= self.block_m or t & (t - 1)):
            raise ValueError(f"tail_m must be 0 or a power of two in [16, block_m), got {t} "
                             f"(block_m {self.block_m})")
        if self.flat and (self.n_per_program or t):
            raise ValueError("a flat tile has no tail tiles and no column blocks per program")
        if self.flat and self.persistent is False:
            raise ValueError("a flat tile is persistent always")
        if self.ws and (self.block_m not in (64, 128) or t or self.flat or self.n_per_program):
            raise ValueError(f"a warp-specialized tile has 64 or 128 rows, no tail tiles and is not a down "
                             f"tile, got {self}")
        if self.split and (not self.ws or self.split < 2):
            raise ValueError(f"split is 0 or >= 2, on a warp-specialized tile only, got {self}")
        if self.fallback is not None and (not self.ws or self.fallback.ws):
            raise ValueError(f"a fallback tile is a Triton tile of a warp-specialized tile, got {self}")

    def triton_tile(self) -> GemmConfig:
        """What runs where this warp-specialized tile's Gluon kernel does not: its ``fallback``,
        else the Triton kernel's tile with the same blocks (TMA, one warp per 16 rows; the same
        numbers, unless the tile splits)."""
        if not self.ws:
            return self
        if self.fallback is not None:
            return self.fallback
        return replace(self, ws=False, split=0, tma=True, num_warps=self.block_m // 16)

    def runs_persistent(self, policy: bool) -> bool:
        """Whether this tile's programs walk the tiles: its own ``persistent``, else the call's
        ``policy``."""
        return policy if self.persistent is None else self.persistent


#: 4-byte inputs (float32: tests, references) take this small tile: shared memory holds twice
#: the bytes per element, and speed does not matter there
FP32_CONFIG = GemmConfig(64, 64, 32, 8, 4, 2, tail_m=16)


#: (largest estimated rows per expert, gate_up tile, down tile, down tile when I <= 256), first
#: match wins. From the tile sweeps on an H200 (tools/probes/tune_experts.py over I 256/768/2048,
#: 32/128/256 local experts, 32-2048 rows per expert; docs/performance.md): 128-row
#: gate/up tiles up to 192 rows per expert, 64-row tiles above (fewer rows computed past each
#: expert's end); the down GEMM's flat persistent tile from 48 rows per expert at I <= 256 and
#: from 96 above, the K-loop 128x256 tile with 16-row tails below. The flat tile is 128x128 with
#: four warps and three stages: two programs fit on an SM (104 KB of shared memory, 198
#: registers), so one program's stores overlap the other's products (0.79-1.02x the 128x256
#: eight-warp tile's time, median 0.95, docs/performance.md); the wide tile stays
#: where the rows are many and so are the experts (``pick_configs``).
DOWN_TAIL = GemmConfig(128, 256, 64, 8, 8, 4, tma=True, tail_m=16)
FLAT_DOWN = GemmConfig(128, 128, 64, 8, 4, 3, flat=True)
FLAT_DOWN_WIDE = GemmConfig(128, 256, 64, 8, 8, 3, flat=True)
CONFIGS: tuple[tuple[int, GemmConfig, GemmConfig, GemmConfig], ...] = (
    (48, GemmConfig(64, 128, 64, 8, 4, 5, tma=True), DOWN_TAIL,
     GemmConfig(64, 64, 256, 8, 4, 4, n_per_program=16)),
    (96, GemmConfig(128, 128, 64, 8, 8, 4, tma=True, tail_m=32), DOWN_TAIL, FLAT_DOWN),
    (192, GemmConfig(128, 128, 64, 8, 8, 4, tma=True, tail_m=32), FLAT_DOWN, FLAT_DOWN),
    (1 << 62, GemmConfig(64, 128, 64, 8, 4, 4, tma=True), FLAT_DOWN, FLAT_DOWN),
)

#: few local experts (<= 64) and up to 96 rows each: too few 128-row tiles to fill the GPU,
#: so I <= 256 takes this small gate/up tile (more programs, plain loads), and up to 48 rows a
#: short-K down tile of 64 x 64 walking 8 column blocks (0.72x the wide flat tile's time at 64
#: rows per expert; the two-per-SM flat tile beats both there: 0.76x, and takes 48-96 rows)
FEW_EXPERTS_UP = GemmConfig(64, 64, 64, 8, 4, 4)
FEW_EXPERTS_DOWN = GemmConfig(64, 64, 256, 8, 4, 3, n_per_program=8)
#: above 192 rows each, few experts at I <= 256 give few tiles too: the gate/up GEMM takes the
#: 64x128 five-stage tile up to 1024 rows and the 128-row tile with 32-row tails above
#: (``pick_configs``; 0.82x and 0.88x the previous tiles at 259 and 2052 rows per expert)

#: the warp-specialized Gluon gate/up tiles (:mod:`dbo.experts.kernels.gluon_gate_up`; on other GPUs than
#: Hopper the Triton kernel with the same blocks): 128 rows from 1024 estimated rows per expert,
#: and split from 96 to 192 (``WS_UP_SPLIT``), 64 rows (one MMA warpgroup, five slots) from 256,
#: except with few experts at I <= 256, where the 128-row tile only pays from 2048 rows and the
#: 64-row one only with its last round split (``WS_UP64_SPLIT``: fewer, larger tiles fill the
#: last wave worse). Same-run A/B of whole calls on an H200 over the grid (I 256/768/2048,
#: 32/128/256 local experts, 1024-65536 tokens; ``tests/gpu/ab_tiles.py`` at 88cef6a, docs/performance.md
#: section 5m): 0.90-0.99x the Triton tiles' time where they are taken, 0.984x over the grid
WS_UP = GemmConfig(128, 128, 64, 8, 8, 4, ws=True)
WS_UP64 = GemmConfig(64, 128, 64, 8, 4, 5, ws=True)
WS_MIN_ROWS = 256
WS_WIDE_MIN_ROWS = 1024
#: few experts at I <= 256 from 256 to 1024 rows per expert: the 64-row tile with its last
#: round's tiles split along K into up to four shares (``GemmConfig.split``). There the tiles are
#: few (~290 at 256 rows per expert, 32 experts: 2.2 rounds of 132 programs) and the last round
#: ran ~20-40% full. Same-run A/B on an H200 (``tests/gpu/ab_tiles.py --variants split4few`` at 88cef6a,
#: docs/performance.md): 0.960 and 0.965 of the Triton tile's whole-call time at
#: I=256, 32 experts, T=8192 and 16384; 0.99-1.00 at the other few-expert rows. Splitting the
#: other shapes' ws tiles gained nothing (0.98-1.04)
WS_UP64_SPLIT = replace(WS_UP64, split=4)
#: 96-192 rows per expert (an expert's rows fill one 128-row tile, and about half of the experts
#: spill a few rows into a second): the 128-row ws tile with its last round split in up to four
#: shares, where the Triton 128-row tile with 32-row tails ran. Same-run A/B of whole calls on an
#: H200 at 128 rows per expert (``tests/gpu/ab_tiles.py --variants ws128s128`` at 88cef6a, two runs, docs/
#: docs/performance.md): 0.97 of the Triton tile's time over the nine (I, local experts)
#: rows, 0.91 at I=768 with 32 experts, 0.95-0.96 at I=256 with 128-256; unsplit the few-expert
#: rows lost 2-3% (a partly filled last round). Off Hopper the Triton tile it replaced runs
WS_UP_SPLIT = replace(WS_UP, split=4, fallback=CONFIGS[2][1])  # (off Hopper: the tile with tails)
WS_SPLIT_ROWS = (96, 192)

#: few experts (<= 64) at wide intermediates (>= 2048) on low-latency slabs
#: (:func:`pick_slab_configs`), from 96 to 1024 rows each: the decode layers of large
#: expert-parallel deployments (8 local experts of DeepSeek-V3's shape on 32 ranks), where the two
#: GEMMs are flops-bound and their tiles few: the 64-row gate/up tile with its last round split,
#: and up to 384 rows a 64 x 256 flat down tile with five stages. Tile sweeps on an H200 over the
#: low-latency decode grid (``tools/probes/batched_experts.py --sweep``, hidden 7168, I=2048;
#: docs/performance.md), each GEMM against the tile it replaced: the gate/up 0.93x / 0.95x / 0.96x
#: at 8 experts x 257 and 513 rows and 32 x 129, the down 0.91x / 0.86x at 8 x 257 and 32 x 129.
#: Whole calls (``tools/probes/ab_tile_rule.py``): 0.96x / 0.98x / 0.94x the previous tiles' time
#: on slabs at 8 x 254, 8 x 516 and 32 x 126 rows, but 1.02x / 1.06x / 1.05x on the STANDARD
#: layout's gathered rows at 32 x 125, 32 x 255 and 64 x 258 (many more tiles there, its own
#: persistence policy): the rule is for slabs only
FEW_EXPERTS_WIDE_MIN_I = 2048
FLAT_DOWN_64 = GemmConfig(64, 256, 64, 8, 4, 5, flat=True)
FEW_EXPERTS_FLAT_DOWN_64_ROWS = 384

#: above this many estimated rows per expert, with I > ``FUSED_MAX_INTERMEDIATE`` and more than
#: ``FUSED_MAX_LOCAL_EXPERTS`` local experts, the unfused steps (CUTLASS's grouped GEMM through
#: ``torch._grouped_mm``) run instead of the fused kernels. Up to I=2048 the fused kernels are as
#: fast or faster at every size measured on an H200 (``tests/gpu/ab_tiles.py`` at 88cef6a, the unfused steps'
#: time over the fused call's: 1.01-1.07 at I=2048, 256 local experts, 1024-2048 rows each, with
#: the warp-specialized gate/up tiles, in four runs; 1.03-1.25 at 32-128 local experts;
#: docs/performance.md), and they launch fewer kernels (host time counts double
#: under DBO). Wider intermediates were not measured: there the unfused steps keep the large sizes
FUSED_MAX_ROWS_PER_EXPERT = 768
FUSED_MAX_LOCAL_EXPERTS = 128
FUSED_MAX_INTERMEDIATE = 2048


def prefer_fused(rows_per_expert: float, intermediate: int, local_experts: int | None = None) -> bool:
    """Whether the fused kernels are expected to beat the unfused steps at this size
    (``local_experts`` unknown: as if many)."""
    few = local_experts is not None and local_experts <= FUSED_MAX_LOCAL_EXPERTS
    return intermediate <= FUSED_MAX_INTERMEDIATE or rows_per_expert <= FUSED_MAX_ROWS_PER_EXPERT or few


def prefer_persistent(rows_per_expert: float, bound_pairs: int, n_experts: int) -> bool:
    """Whether the grouped GEMMs run persistent (a program per resident slot, walking the tiles)
    rather than one program per tile of the host's bound. Measured on an H200
    (``tests/gpu/ab_experts.py`` at 88cef6a): persistent is 3-9% faster where the bound counts at least
    twice the expected local pairs (a local share of the experts <= 1/2 without host counts: the
    bound's programs are mostly empty) and the experts get more than 192 rows each, but 14-26%
    slower at 96-192 rows per expert, where the tail tiles make tiles of unequal cost (the
    hardware's scheduling of one program per tile balances them better)."""
    return rows_per_expert > 192 and bound_pairs >= 2 * rows_per_expert * n_experts


#: the least expected share of tokens with exactly one local slot for which the flat down kernel
#: writes those tokens' rows to the output itself (``fused_swiglu_experts(sole_pairs=...)``)
SOLE_MIN_SHARE = 0.2


def prefer_sole(local_share: float, topk: int) -> bool:
    """Whether the down GEMM should write the rows of tokens with one local slot straight to the
    output, given the expected share of slots routed to local experts: worth it where such
    tokens are many (at 32 of 256 experts with top-8 routing ~39% of tokens; none when every
    expert is local), since each row it writes saves the top-k sum's copy of it, and every
    local row pays for reading its token's expert ids once (the tile map's launch) and its mark
    once per column block (the down kernel's epilogue)."""
    p = min(1.0, max(0.0, local_share))
    return topk * p * (1.0 - p) ** (topk - 1) >= SOLE_MIN_SHARE


def _ws_up(up: GemmConfig, rows: float, intermediate: int, local_experts: int | None) -> GemmConfig:
    # the warp-specialized gate/up tiles where they pay (see WS_UP and WS_UP_SPLIT)
    if intermediate % WS_UP.block_n:
        return up
    if WS_SPLIT_ROWS[0] < rows <= WS_SPLIT_ROWS[1]:
        return WS_UP_SPLIT
    if rows < WS_MIN_ROWS:
        return up
    if intermediate <= 256 and local_experts is not None and local_experts <= 64:
        return WS_UP if rows > WS_WIDE_MIN_ROWS else WS_UP64_SPLIT
    return WS_UP if rows >= WS_WIDE_MIN_ROWS else WS_UP64


def pick_configs(rows_per_expert: float, intermediate: int = 1 << 30,
                 local_experts: int | None = None) -> tuple[GemmConfig, GemmConfig]:
    """The ``(gate_up, down)`` tiles for an estimated number of rows per local expert."""
    few = local_experts is not None and local_experts <= 64
    for bound, up, down, down_short in CONFIGS:
        if rows_per_expert <= bound:
            if intermediate <= 256:
                down = down_short
                if few and rows_per_expert <= 96:
                    up, down = FEW_EXPERTS_UP, FEW_EXPERTS_DOWN if rows_per_expert <= 48 else FLAT_DOWN
                elif few and rows_per_expert > 192:  # 0.82-0.92x the tiles below (H200 sweep)
                    up = CONFIGS[0][1] if rows_per_expert <= 1024 else CONFIGS[2][1]
                elif 192 < rows_per_expert <= 384:
                    up = CONFIGS[2][1]  # I <= 256 keeps the 128-row tile to 384 rows
            elif down is FLAT_DOWN and rows_per_expert > 1024 and (local_experts or 1 << 30) > 64:
                down = FLAT_DOWN_WIDE  # 0.79-0.86x the 128x128 tile's time at 2048 rows, 256 experts
            return _ws_up(up, rows_per_expert, intermediate, local_experts), down
    raise AssertionError("the last CONFIGS bound covers every size")


def pick_slab_configs(rows_per_expert: float, intermediate: int = 1 << 30,
                      local_experts: int | None = None) -> tuple[GemmConfig, GemmConfig]:
    """The ``(gate_up, down)`` tiles on low-latency slabs (:mod:`dbo.experts.kernels.batched`): few
    experts at wide intermediates take the tiles of ``FLAT_DOWN_64``'s rule, every other size
    :func:`pick_configs`'."""
    rows = rows_per_expert
    few = local_experts is not None and local_experts <= 64
    if few and intermediate >= FEW_EXPERTS_WIDE_MIN_I and WS_SPLIT_ROWS[0] < rows <= WS_WIDE_MIN_ROWS \
            and intermediate % WS_UP64.block_n == 0:
        return WS_UP64_SPLIT, FLAT_DOWN_64 if rows <= FEW_EXPERTS_FLAT_DOWN_64_ROWS else FLAT_DOWN
    return pick_configs(rows_per_expert, intermediate, local_experts)
