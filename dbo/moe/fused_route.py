"""Routing for the fused experts: the (token, slot) pairs sorted by local expert, on the device.

:func:`route_order` returns each sorted row's pair and each expert's end row without reading
anything back: up to ``ROUTE_MAX_PAIRS`` pairs a counting sort in two Triton launches, above it
torch's radix sort on 16-bit keys and a ``searchsorted``.
"""

from __future__ import annotations

import torch

from dbo.moe.triton_launch import cdiv, launch, next_pow2

__all__ = ["ROUTE_CHUNK", "ROUTE_MAX_CELLS", "ROUTE_MAX_PAIRS", "route_order", "uses_counting_sort"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:

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
                            CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
        # a counting sort: expert e's rows start after every smaller expert's rows and after
        # expert e's rows of the earlier chunks; within the chunk a pair's rank among its
        # expert's pairs is its place in the sorted chunk minus where its expert starts there
        c = tl.program_id(0)
        es = tl.arange(0, BLOCK_E)
        cs = tl.arange(0, BLOCK_C)
        h = tl.load(hist_ptr + cs[:, None] * BLOCK_E + es[None, :], mask=(cs < n_chunks)[:, None], other=0)
        total = tl.sum(h, 0)
        before = tl.sum(tl.where((cs < c)[:, None], h, 0), 0)
        own = tl.sum(tl.where((cs == c)[:, None], h, 0), 0)
        ends = tl.cumsum(total, 0)
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
        tl.store(order_ptr + pos, c * CHUNK + v % CHUNK, mask=local)


#: pairs per program of the Triton counting sort; the most (chunks x padded experts) cells of
#: its histogram that each program of the second launch reads whole (above, torch.sort): 64K
#: pairs at 256 local experts, 512K at 32
ROUTE_CHUNK = 1024
ROUTE_MAX_CELLS = 64 * 256
#: the most pairs the counting sort takes at 256 local experts (any count up to 256)
ROUTE_MAX_PAIRS = ROUTE_MAX_CELLS // 256 * ROUTE_CHUNK


def uses_counting_sort(num_pairs: int, num_local_experts: int) -> bool:
    """Whether :func:`route_order` sorts ``num_pairs`` pairs with the Triton counting sort."""
    return num_pairs > 0 and cdiv(num_pairs, ROUTE_CHUNK) * max(16, next_pow2(num_local_experts)) \
        <= ROUTE_MAX_CELLS


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
        block_e = max(16, next_pow2(num_local_experts))
        chunks = cdiv(n, ROUTE_CHUNK)
        scratch = torch.empty(2, chunks, block_e, dtype=torch.int32, device=ids.device)
        order = torch.empty(n, dtype=torch.int32, device=ids.device)
        offsets = torch.empty(num_local_experts, dtype=torch.int32, device=ids.device)
        launch(_route_count_kernel, (chunks,), (ids, scratch[0], n, num_local_experts),
               dict(CHUNK=ROUTE_CHUNK, BLOCK_E=block_e))
        launch(_route_place_kernel, (chunks,), (ids, scratch[0], scratch[1], order, offsets, n,
               num_local_experts, chunks), dict(CHUNK=ROUTE_CHUNK, BLOCK_E=block_e,
               BLOCK_C=max(2, next_pow2(chunks)), num_warps=8))
        return order, offsets
    key = torch.empty(n, dtype=torch.int16, device=ids.device)
    launch(_route_keys_kernel, (cdiv(n, 1024),), (ids, key, n, num_local_experts), dict(BLOCK=1024))
    sorted_key, order = torch.sort(key)
    if bounds is None:
        bounds = torch.arange(1, num_local_experts + 1, dtype=torch.int16, device=ids.device)
    offsets = torch.searchsorted(sorted_key, bounds).to(torch.int32)
    return order, offsets
