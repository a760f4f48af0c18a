"""The row-tile maps of the fused experts' map-driven kernels (the flat down GEMM and the
warp-specialized gate/up GEMM): each expert's sorted rows in tiles of ``block_m`` rows, the tiles
in groups that never span two experts, built on the device without reading anything back.

A map is int32 ``[1 + MAP_ENTRY * bound]``: ``[0]`` the row tiles' count, then per row tile (in
expert order) its expert, first row, the expert's end row, its group's first row tile and the
group's size. :func:`tile_maps` builds one or two maps (two tile heights or group sizes), the sole
rows' marks and zeroed counters in one launch; the counting sort of :mod:`dbo.experts.kernels.fused_route`
builds them in its second launch instead (its programs past the chunks run :func:`map_tiles`).
The kernels find tile ``t``'s row tile and column block with ``map_tile``.
"""

from __future__ import annotations

import torch

from dbo.experts.kernels.fused_tiles import GemmConfig
from dbo.kernels.triton_launch import cdiv, launch, next_pow2

__all__ = ["MAP_ENTRY", "MAP_GROUP_M", "TILE_MAP_BLOCK", "SOLE_ROWS_BLOCK", "block_e", "tile_maps",
           "tile_map"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:

    @triton.jit
    def map_tiles(starts, ends, live, map_ptr, max_tiles, block, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_J: tl.constexpr, GROUP_M: tl.constexpr):
        # block `block` of the row tiles of BLOCK_M rows of the experts whose first and end rows
        # are starts and ends ([BLOCK_E], live the real experts; see tile_map_kernel). An
        # expert's row tiles form ceil(tiles / GROUP_M) groups of as equal sizes as can be
        m_tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = tl.where(live, tl.cumsum(m_tiles, 0), 2147483647)
        total = tl.sum(m_tiles, 0)
        if block == 0:
            tl.store(map_ptr, total)
        j = block * BLOCK_J + tl.arange(0, BLOCK_J)
        keep = (j < total) & (j < max_tiles)
        before = tile_ends[None, :] <= j[:, None]
        e = tl.sum(before.to(tl.int32), 1)
        first_tile = tl.max(tl.where(before, tile_ends[None, :], 0), 1)
        first_row = tl.max(tl.where(before, ends[None, :], 0), 1)
        own = tl.arange(0, BLOCK_E)[None, :] == e[:, None]
        end_row = tl.sum(tl.where(own, ends[None, :], 0), 1)
        # group c of the expert's n tiles (in k groups) starts at its tile ceil(c * n / k): tile
        # i is in group floor(i * k / n)
        n = tl.maximum(tl.sum(tl.where(own, m_tiles[None, :], 0), 1), 1)
        k = (n + GROUP_M - 1) // GROUP_M
        c = (j - first_tile) * k // n
        g0 = (c * n + k - 1) // k
        g1 = ((c + 1) * n + k - 1) // k
        out = map_ptr + 1 + 5 * j  # (MAP_ENTRY int32 per tile)
        tl.store(out, e, mask=keep)
        tl.store(out + 1, first_row + (j - first_tile) * BLOCK_M, mask=keep)
        tl.store(out + 2, end_row, mask=keep)
        tl.store(out + 3, first_tile + g0, mask=keep)
        tl.store(out + 4, g1 - g0, mask=keep)

    @triton.jit
    def map_row_tile(t, map_ptr, n_col):
        # tile t of a map's row tiles x n_col column blocks -> (row tile, column block): a
        # group's row tiles take each column block one after the other (so that they read its
        # weight tile from L2 together), and no group holds two experts. The Gluon gate/up kernel
        # walks the same way in its own _tile (Gluon calls no Triton function): change both
        # together
        q = t // n_col  # a row tile of t's group (the group's tiles are n_col times its rows)
        g0 = tl.load(map_ptr + 4 + 5 * q)
        gn = tl.load(map_ptr + 5 + 5 * q)
        local = t - g0 * n_col
        return g0 + local % gn, local // gn

    @triton.jit
    def map_tile(t, map_ptr, n_col):
        # tile t -> (expert, first row, the expert's end row, column block), by map_row_tile
        pid_m, pid_n = map_row_tile(t, map_ptr, n_col)
        e = tl.load(map_ptr + 1 + 5 * pid_m)
        row0 = tl.load(map_ptr + 2 + 5 * pid_m)
        end_row = tl.load(map_ptr + 3 + 5 * pid_m)
        return e, row0, end_row, pid_n

    @triton.jit
    def mark_sole(ids_ptr, slots, live, n_experts, TOPK: tl.constexpr, BLOCK_T: tl.constexpr):
        # ~slot where the slot's token has no other local slot (ids_ptr [M, TOPK]), else slot
        ks = tl.arange(0, BLOCK_T)
        ids = tl.load(ids_ptr + (slots // TOPK)[:, None].to(tl.int64) * TOPK + ks[None, :],
                      mask=live[:, None] & (ks < TOPK)[None, :], other=-1)
        n_local = tl.sum(((ids >= 0) & (ids < n_experts)).to(tl.int32), 1)
        return tl.where(n_local == 1, ~slots, slots)

    @triton.jit
    def zero_counters(zero_ptr, n_zero, ZERO_BLOCK: tl.constexpr):
        for z in range(0, n_zero, ZERO_BLOCK):
            zs = z + tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + zs, tl.zeros([ZERO_BLOCK], tl.int32), mask=zs < n_zero)

    @triton.jit
    def tile_map_kernel(offs_ptr, map_ptr, n_experts, max_tiles, order_ptr, ids_ptr, dest_ptr, map2_ptr,
                        max_tiles2, zero_ptr, n_zero, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_J: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_R: tl.constexpr, SOLE: tl.constexpr, BLOCK_M2: tl.constexpr,
                        ZERO_BLOCK: tl.constexpr, GROUP_M: tl.constexpr, GROUP_M2: tl.constexpr):
        # the row tiles of BLOCK_M rows, in expert order, for down_flat_kernel and the Gluon
        # gate/up kernel: map[0] their count, map[1 + 5j : 6 + 5j] row tile j's expert, first
        # row, the expert's end row, its group's first row tile and size (map_tiles: at most
        # GROUP_M tiles, of one expert). Row tile j belongs to the expert whose tiles start at or
        # before j and end after it: the experts whose tiles end at or before j (their tile ends
        # do not decrease) are counted, and the largest of their tile ends and end rows are tile
        # j's expert's first tile and first row. BLOCK_M2 > 0: the next programs write map2,
        # the same of BLOCK_M2 rows (groups of GROUP_M2). SOLE: the programs past the maps mark
        # each sorted row whose token has no other local slot (ids_ptr [M, TOPK]): dest[r] =
        # ~order[r] there, order[r] else. ZERO_BLOCK > 0: program 0 also zeroes
        # zero_ptr[:n_zero] (int32 counters), so that they need no launch of their own
        pid = tl.program_id(0)
        if ZERO_BLOCK > 0:  # noqa: SIM102 (a constexpr test: the body is not compiled at 0)
            if pid == 0:
                zero_counters(zero_ptr, n_zero, ZERO_BLOCK)
        n_map = tl.cdiv(max_tiles, BLOCK_J)
        n_map2 = tl.cdiv(max_tiles2, BLOCK_J)  # (the host passes 0 without a second map)
        if pid < n_map + n_map2:
            # (the names differ from the other branch's: Triton types a name across both)
            es = tl.arange(0, BLOCK_E)
            real = es < n_experts
            ends = tl.load(offs_ptr + es, mask=real, other=0)
            starts = tl.load(offs_ptr + es - 1, mask=real & (es > 0), other=0)
            if pid < n_map:
                map_tiles(starts, ends, real, map_ptr, max_tiles, pid, BLOCK_M, BLOCK_E, BLOCK_J, GROUP_M)
            elif BLOCK_M2 > 0:
                map_tiles(starts, ends, real, map2_ptr, max_tiles2, pid - n_map, BLOCK_M2, BLOCK_E, BLOCK_J,
                          GROUP_M2)
        elif SOLE:
            rows = (pid - n_map - n_map2) * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < tl.load(offs_ptr + n_experts - 1)
            slots = tl.load(order_ptr + rows, mask=live, other=0)
            tl.store(dest_ptr + rows, mark_sole(ids_ptr, slots, live, n_experts, TOPK, BLOCK_T), mask=live)


#: int32 entries per row tile of a row-tile map (after its count): the expert, the tile's first
#: row, the expert's end row, its group's first row tile and the group's size
MAP_ENTRY = 5
#: the most row tiles of one group of a map by default, a tile's default ``group_m`` (an expert
#: with more has several, of as equal sizes as can be); a group's row tiles take each column
#: block one after the other
MAP_GROUP_M = GemmConfig.group_m


def block_e(n_experts: int) -> int:
    """The kernels' ``BLOCK_E``: the experts padded to a power of two, at least 16."""
    return max(16, next_pow2(n_experts))


def zeroing(zero: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A launch's arguments for zeroing ``zero`` (int32 counters): its pointer (``stand_in``,
    unread, without one), their count and the kernel's ``ZERO_BLOCK`` (0: nothing to zero)."""
    if zero is None:
        return stand_in, 0, 0
    if zero.dtype != torch.int32 or not zero.is_contiguous():
        raise ValueError(f"zero must be a contiguous int32 tensor, got {zero.dtype}")
    return zero, zero.numel(), 256


def check_groups(groups: tuple[int, ...] | None, heights: tuple[int, ...]) -> tuple[int, ...]:
    # each map's most row tiles per group (default MAP_GROUP_M), checked
    groups = (MAP_GROUP_M,) * len(heights) if groups is None else tuple(groups)
    if len(groups) != len(heights) or any(g < 1 for g in groups):
        raise ValueError(f"a group size >= 1 per map, got {groups} for heights {heights}")
    return groups


#: row tiles per program of :func:`tile_map`, and sorted rows per program of its ``sole`` part
TILE_MAP_BLOCK = 64
SOLE_ROWS_BLOCK = 512


def tile_maps(offsets: torch.Tensor, block_ms: tuple[int, ...], pairs: int,
              sole: tuple[torch.Tensor, torch.Tensor] | None = None, zero: torch.Tensor | None = None,
              groups: tuple[int, ...] | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The row tiles of each of one or two tile heights ``block_ms`` for the experts whose end
    rows are ``offsets``, for the flat down kernel and the warp-specialized gate/up kernel: per
    height an int32 ``[1 + MAP_ENTRY * bound]``, ``[0]`` their count, then per row tile (in
    expert order) its expert, first row, the expert's end row, and its group's first row tile and
    size. ``pairs`` bounds the rows (``bound = ceil(pairs / block_m) + E``). One launch, nothing
    read back.

    The groups (``groups``: the most row tiles of one per map, default :data:`MAP_GROUP_M`) never
    hold two experts' tiles: an expert's ``n`` row tiles form ``ceil(n / group)`` groups of as
    equal sizes as can be. The kernels walk a group's tiles column block by column block
    (``map_tile``), so the row tiles that multiply one weight tile run at about the same time and
    read it from L2, not from memory again.

    ``sole``: ``(order, topk_ids)``: the same launch also returns ``dest`` (``order``'s dtype,
    ``[pairs]``): ``order[r]``, or ``~order[r]`` where row ``r``'s token has no other local slot
    (the rows past the local pairs unwritten); else ``None``. ``zero``: an int32 tensor the same
    launch fills with zeros (the split gate/up kernel's counters), which saves it a launch."""
    n_experts = offsets.numel()
    maps = new_maps(block_ms, pairs, n_experts, offsets.device)
    groups = check_groups(groups, block_ms)
    bounds = [map_bound(t) for t in maps]
    grid = sum(cdiv(b, TILE_MAP_BLOCK) for b in bounds)
    order, ids, dest, topk = offsets, offsets, None, 1  # (unread without sole)
    if sole is not None:
        order, ids = sole
        topk = ids.shape[1]
        dest = torch.empty(pairs, dtype=order.dtype, device=order.device)
        grid += cdiv(pairs, SOLE_ROWS_BLOCK)
    zero_arg, n_zero, zero_block = zeroing(zero, maps[0])
    second = len(block_ms) == 2
    launch(tile_map_kernel, (grid,), (offsets, maps[0], n_experts, bounds[0], order, ids,
                                      maps[0] if dest is None else dest, maps[-1],
                                      bounds[1] if second else 0, zero_arg, n_zero), dict(
        BLOCK_M=block_ms[0], BLOCK_E=block_e(n_experts), BLOCK_J=TILE_MAP_BLOCK, TOPK=topk,
        BLOCK_T=next_pow2(topk), BLOCK_R=SOLE_ROWS_BLOCK, SOLE=sole is not None,
        BLOCK_M2=block_ms[1] if second else 0, ZERO_BLOCK=zero_block, GROUP_M=groups[0],
        GROUP_M2=groups[-1]))
    return maps, dest


def map_bound(tiles: torch.Tensor) -> int:
    # the most row tiles a map holds: its entries are their count, then MAP_ENTRY per tile
    return (tiles.numel() - 1) // MAP_ENTRY


def new_maps(block_ms: tuple[int, ...], pairs: int, n_experts: int, device) -> tuple[torch.Tensor, ...]:
    if not 1 <= len(block_ms) <= 2:
        raise ValueError(f"one or two tile heights, got {block_ms}")
    return tuple(torch.empty(1 + MAP_ENTRY * (cdiv(pairs, bm) + n_experts), dtype=torch.int32, device=device)
                 for bm in block_ms)


def tile_map(offsets: torch.Tensor, block_m: int, pairs: int,
             sole: tuple[torch.Tensor, torch.Tensor] | None = None, group_m: int = MAP_GROUP_M,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`tile_maps` of one tile height: ``(its map, dest)``."""
    maps, dest = tile_maps(offsets, (block_m,), pairs, sole, groups=(group_m,))
    return maps[0], dest
