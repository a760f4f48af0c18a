"""Routing for the fused experts: the (token, slot) pairs sorted by local expert, and the row
tiles the GEMMs walk, on the device.

:func:`route_order` returns each sorted row's pair and each expert's end row without reading
anything back: up to ``ROUTE_MAX_PAIRS`` pairs a counting sort in two Triton launches, above it
torch's radix sort on 16-bit keys and a ``searchsorted``. :func:`dbo.experts.kernels.fused_maps.tile_maps`
lists the experts' row tiles (for the flat down kernel and the warp-specialized gate/up kernel),
marks the rows whose token has one local slot, and zeroes the split gate/up kernel's counters, in
one launch; :func:`route_with_maps` does both, where the counting sort runs in its second launch.
"""

from __future__ import annotations

import torch

from dbo.experts.kernels.fused_maps import (
    TILE_MAP_BLOCK,
    block_e,
    check_groups,
    map_bound,
    new_maps,
    tile_maps,
    zeroing,
)
from dbo.kernels.triton_launch import cdiv, launch, next_pow2

__all__ = ["ROUTE_CHUNK", "ROUTE_MAX_CELLS", "ROUTE_MAX_PAIRS", "route_order", "route_order_with_maps",
           "uses_counting_sort", "route_with_maps"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:
    from dbo.experts.kernels.fused_maps import map_tiles, mark_sole, zero_counters

    @triton.jit
    def _route_keys_kernel(ids_ptr, key_ptr, n, n_experts, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        ids = tl.load(ids_ptr + i, mask=mask, other=-1)
        local = (ids >= 0) & (ids < n_experts)
        tl.store(key_ptr + i, tl.where(local, ids, n_experts).to(tl.int16), mask=mask)

    @triton.jit
    def _route_count_kernel(ids_ptr, hist_ptr, n, n_experts, CHUNK: tl.constexpr,
                            BLOCK_E: tl.constexpr):
        # hist[c, e]: pairs of chunk c routed to local expert e
        c = tl.program_id(0)
        i = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
        local = (ids >= 0) & (ids < n_experts)
        tl.store(hist_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E),
                 tl.histogram(tl.where(local, ids, 0).to(tl.int32), BLOCK_E, mask=local))

    @triton.jit
    def _route_place_kernel(ids_ptr, hist_ptr, adj_ptr, order_ptr, offs_ptr, n, n_experts, n_chunks,
                            dest_ptr, map_ptr, max_tiles, map2_ptr, max_tiles2, zero_ptr, n_zero,
                            CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                            TOPK: tl.constexpr, BLOCK_T: tl.constexpr, SOLE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_J: tl.constexpr,
                            ZERO_BLOCK: tl.constexpr, GROUP_M: tl.constexpr, GROUP_M2: tl.constexpr):
        # a counting sort: expert e's rows start after every smaller expert's rows and after
        # expert e's rows of the earlier chunks; within the chunk a pair's rank among its
        # expert's pairs is its place in the sorted chunk minus where its expert starts there.
        # SOLE: dest[row] = the row's pair, ~pair where its token has no other local slot. The
        # programs past the chunks build the row-tile maps of BLOCK_M (> 0) and BLOCK_M2 (> 0)
        # rows (tile_map_kernel's maps: each computes the experts' rows from the
        # histogram itself, since offs is this launch's output); ZERO_BLOCK > 0: program 0 zeroes
        # zero_ptr[:n_zero] (the split gate/up kernel's counters)
        c = tl.program_id(0)
        es = tl.arange(0, BLOCK_E)
        cs = tl.arange(0, BLOCK_C)
        h = tl.load(hist_ptr + cs[:, None] * BLOCK_E + es[None, :], mask=(cs < n_chunks)[:, None], other=0)
        total = tl.sum(h, 0)
        ends = tl.cumsum(total, 0)
        if ZERO_BLOCK > 0:  # noqa: SIM102 (a constexpr test: the body is not compiled at 0)
            if c == 0:
                zero_counters(zero_ptr, n_zero, ZERO_BLOCK)
        if c < n_chunks:
            before = tl.sum(tl.where((cs < c)[:, None], h, 0), 0)
            own = tl.sum(tl.where((cs == c)[:, None], h, 0), 0)
            if c == 0:
                tl.store(offs_ptr + es, ends, mask=es < n_experts)
            # adj[e] = expert e's first row for this chunk - its first place in the sorted chunk
            tl.store(adj_ptr + c * BLOCK_E + es, ends - total + before - (tl.cumsum(own, 0) - own))
            tl.debug_barrier()
            i = tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + c * CHUNK + i, mask=c * CHUNK + i < n, other=-1)
            key = tl.where((ids >= 0) & (ids < n_experts), ids, BLOCK_E).to(tl.int32)
            v = tl.sort(key * CHUNK + i)  # other ranks' pairs (and past the end) sort last
            e = v // CHUNK
            local = e < n_experts
            pos = tl.load(adj_ptr + c * BLOCK_E + e, mask=local, other=0) + i
            pair = c * CHUNK + v % CHUNK
            tl.store(order_ptr + pos, pair, mask=local)
            if SOLE:
                marked = mark_sole(ids_ptr, pair, local, n_experts, TOPK, BLOCK_T)
                tl.store(dest_ptr + pos, marked, mask=local)
        elif BLOCK_M > 0:
            live = es < n_experts
            starts = ends - total
            j = c - n_chunks
            n_map = tl.cdiv(max_tiles, BLOCK_J)
            if j < n_map:
                map_tiles(starts, ends, live, map_ptr, max_tiles, j, BLOCK_M, BLOCK_E, BLOCK_J, GROUP_M)
            elif BLOCK_M2 > 0:
                map_tiles(starts, ends, live, map2_ptr, max_tiles2, j - n_map, BLOCK_M2, BLOCK_E, BLOCK_J,
                          GROUP_M2)


#: pairs per program of the Triton counting sort; the most (chunks x padded experts) cells of
#: its histogram that each program of the second launch reads whole (above, torch.sort): 64K
#: pairs at 256 local experts, 512K at 32
ROUTE_CHUNK = 1024
ROUTE_MAX_CELLS = 64 * 256
#: the most pairs the counting sort takes at 256 local experts (any count up to 256)
ROUTE_MAX_PAIRS = ROUTE_MAX_CELLS // 256 * ROUTE_CHUNK


def uses_counting_sort(num_pairs: int, num_local_experts: int) -> bool:
    """Whether :func:`route_order` sorts ``num_pairs`` pairs with the Triton counting sort."""
    return num_pairs > 0 and cdiv(num_pairs, ROUTE_CHUNK) * block_e(num_local_experts) <= ROUTE_MAX_CELLS


def route_order(topk_ids: torch.Tensor, num_local_experts: int,
                bounds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the pairs of ``topk_ids`` (``[M, topk]`` local ids, others ``-1`` or out of range)
    by local expert on the device.

    Returns ``(order, offsets)``: ``order`` ``[M * topk]`` int32 (int64 for the radix sort),
    the pair (``m * topk + s``) of each sorted row (the local pairs first; past ``offsets[-1]``
    unspecified); ``offsets`` ``[E]`` int32, each expert's end row. Where the chunks' histogram
    fits (:func:`uses_counting_sort`: ``ROUTE_MAX_PAIRS`` pairs at 256 local experts, 8x that at
    32) a counting sort in two Triton launches (a histogram per chunk, then the places), where
    torch's radix sort and the ``searchsorted`` take about ten launches, ~0.1 ms of host time
    and 40-60 us of GPU time (H200, 128K-512K pairs); above it the radix sort
    (``bounds``: optional cached ``arange(1, E + 1)`` int16 on the device for its
    ``searchsorted``). The order inside an expert is not fixed and changes no sum (each row is
    its own output). No host sync.
    """
    if num_local_experts >= 2**15 - 1:
        raise ValueError(f"at most {2**15 - 2} local experts, got {num_local_experts}")
    ids = topk_ids.reshape(-1).contiguous()
    n = ids.numel()
    if uses_counting_sort(n, num_local_experts):
        return _counting_sort(topk_ids, num_local_experts)
    key = torch.empty(n, dtype=torch.int16, device=ids.device)
    launch(_route_keys_kernel, (cdiv(n, 1024),), (ids, key, n, num_local_experts), dict(BLOCK=1024))
    sorted_key, order = torch.sort(key)
    if bounds is None:
        bounds = torch.arange(1, num_local_experts + 1, dtype=torch.int16, device=ids.device)
    offsets = torch.searchsorted(sorted_key, bounds).to(torch.int32)
    return order, offsets


def route_order_with_maps(topk_ids: torch.Tensor, num_local_experts: int, maps: tuple[torch.Tensor, ...],
                          heights: tuple[int, ...], map_block: int, dest: torch.Tensor | None = None,
                          zero: torch.Tensor | None = None, groups: tuple[int, ...] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`route_order`'s counting sort whose second launch also writes, from its histogram,
    the row-tile maps ``maps`` of ``heights`` rows and ``groups`` row tiles per group at most
    (one or two; int32 ``[1 + MAP_ENTRY * bound]`` each, as :func:`tile_maps` builds them with
    ``map_block`` tiles per program),
    ``dest`` (the sorted rows' pairs, ``~pair`` where the pair's token has no other local slot)
    and zeros in ``zero`` (int32): the launches of ``tile_maps`` saved. ``None`` (nothing
    launched) where the counting sort does not take this size."""
    n = topk_ids.numel()
    if not uses_counting_sort(n, num_local_experts):
        return None
    if not 1 <= len(maps) == len(heights) <= 2:
        raise ValueError(f"one or two maps with their heights, got {len(maps)} and {heights}")
    if dest is not None and topk_ids.dim() != 2:
        raise ValueError(f"marking the sole rows needs [M, topk] ids, got shape {tuple(topk_ids.shape)}")
    return _counting_sort(topk_ids, num_local_experts, maps, heights, map_block, dest, zero,
                          check_groups(groups, heights))


def _counting_sort(topk_ids: torch.Tensor, num_local_experts: int, maps: tuple[torch.Tensor, ...] = (),
                   heights: tuple[int, ...] = (), map_block: int = 1, dest: torch.Tensor | None = None,
                   zero: torch.Tensor | None = None, groups: tuple[int, ...] = (),
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = topk_ids.reshape(-1).contiguous()
    n = ids.numel()
    zero_arg, n_zero, zero_block = zeroing(zero, ids)
    padded = block_e(num_local_experts)
    chunks = cdiv(n, ROUTE_CHUNK)
    scratch = torch.empty(2, chunks, padded, dtype=torch.int32, device=ids.device)
    order = torch.empty(n, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(num_local_experts, dtype=torch.int32, device=ids.device)
    launch(_route_count_kernel, (chunks,), (ids, scratch[0], n, num_local_experts),
           dict(CHUNK=ROUTE_CHUNK, BLOCK_E=padded))
    bounds = [map_bound(m) for m in maps] + [0, 0]  # (0: no such map)
    map_programs = sum(cdiv(b, map_block) for b in bounds)
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    launch(_route_place_kernel, (chunks + map_programs,), (
        ids, scratch[0], scratch[1], order, offsets, n, num_local_experts, chunks,
        order if dest is None else dest, maps[0] if maps else order, bounds[0],
        maps[-1] if maps else order, bounds[1], zero_arg, n_zero), dict(
        CHUNK=ROUTE_CHUNK, BLOCK_E=padded, BLOCK_C=max(2, next_pow2(chunks)), TOPK=topk,
        BLOCK_T=next_pow2(topk), SOLE=dest is not None, BLOCK_M=heights[0] if heights else 0,
        BLOCK_M2=heights[1] if len(heights) == 2 else 0, BLOCK_J=map_block, ZERO_BLOCK=zero_block,
        GROUP_M=groups[0] if groups else 1, GROUP_M2=groups[1] if len(groups) == 2 else 1, num_warps=8))
    return order, offsets


def route_with_maps(topk_ids: torch.Tensor, n_experts: int, block_ms: tuple[int, ...], pairs: int,
                    sole: bool, zero: torch.Tensor | None = None, bounds: torch.Tensor | None = None,
                    groups: tuple[int, ...] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """:func:`route_order` and :func:`tile_maps` (``sole``: with the marks, ``dest``; ``groups``:
    each map's most row tiles per group): ``(order, offsets, maps, dest)``. Where the counting
    sort runs, its second launch builds the maps, the marks and the zeros too
    (:func:`dbo.experts.kernels.fused_route.route_order_with_maps`): the same values in one launch fewer."""
    if uses_counting_sort(topk_ids.numel(), n_experts):
        maps = new_maps(block_ms, pairs, n_experts, topk_ids.device)
        dest = torch.empty(pairs, dtype=torch.int32, device=topk_ids.device) if sole else None
        routed = route_order_with_maps(topk_ids, n_experts, maps, block_ms, TILE_MAP_BLOCK, dest, zero,
                                       groups)
        return *routed, maps, dest
    order, offsets = route_order(topk_ids, n_experts, bounds)
    maps, dest = tile_maps(offsets, block_ms, pairs, (order, topk_ids) if sole else None, zero, groups)
    return order, offsets, maps, dest
