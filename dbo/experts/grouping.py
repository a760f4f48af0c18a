"""Group the (token, slot) pairs of a STANDARD-format batch by local expert, without a host sync.

The grouped GEMM wants the rows of each expert contiguous and each expert's end row (its
offset). Both come from one stable sort of the flattened ``topk_ids`` on the device; the
offsets from a ``searchsorted`` of the sorted keys, so nothing is read back to the host. How
many rows there are is then known only on the device: without host-side counts every slot gets a
row (``M * topk`` rows, the pairs of other ranks' experts sorted last and never computed); with
the counts the backend already has on the host (DeepEP normal mode), exactly the local pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertGroups", "group_by_expert"]


@dataclass(frozen=True)
class ExpertGroups:
    """Where each (token, slot) pair's row lives once the rows are sorted by local expert.

    Attributes:
        tokens: ``[R]`` int64, the token whose activations row ``r`` reads (token 0 for rows
            past the local pairs: they are never computed, and reading one row over and over
            costs almost nothing).
        offsets: ``[E]`` int32 on the device, the end row of each local expert (``offsets[-1]``
            is the number of local pairs).
        slot_rows: ``[M, topk]`` int64, the row that holds each slot's expert output (0 for a
            slot routed to no local expert).
        local: ``[M, topk]`` bool, the slot's expert is local.
        num_rows: ``R``: the local pairs when the host counts were given, else ``M * topk``.
        host_counts: the per-expert counts the caller gave, or None.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    slot_rows: torch.Tensor
    local: torch.Tensor
    num_rows: int
    host_counts: tuple[int, ...] | None

    @property
    def num_valid(self) -> torch.Tensor:
        """``[1]`` int32 on the device: rows that belong to a local expert."""
        return self.offsets[-1:]


def _offsets_from_host(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    ends, acc = [], 0
    for c in counts:
        acc += c
        ends.append(acc)
    host = torch.tensor(ends, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    # pinned + non_blocking: a plain host-to-device copy would wait for the GPU
    return host.pin_memory().to(device, non_blocking=True)


def group_by_expert(topk_ids: torch.Tensor, num_local_experts: int,
                    host_counts: torch.Tensor | None = None) -> ExpertGroups:
    """Sort the pairs of ``topk_ids`` by local expert on the device.

    Args:
        topk_ids: ``[M, topk]`` int32/int64 LOCAL expert ids, ``-1`` (or any id outside
            ``[0, num_local_experts)``) for a slot routed elsewhere.
        num_local_experts: ``E`` > 0.
        host_counts: optional ``[E]`` integer tensor on the CPU, the pairs per local expert
            (``ExpertTokensMetadata.expert_num_tokens_cpu``); it must be right: it is trusted,
            not checked (checking would read the device).

    Returns:
        :class:`ExpertGroups`. No operation waits for the GPU.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, topk], got shape {tuple(topk_ids.shape)}")
    if num_local_experts <= 0:
        raise ValueError(f"num_local_experts must be positive, got {num_local_experts}")
    counts = None
    if host_counts is not None:
        if host_counts.device.type != "cpu" or host_counts.numel() != num_local_experts:
            raise ValueError(f"host_counts must be a CPU tensor of {num_local_experts} counts, got "
                             f"{tuple(host_counts.shape)} on {host_counts.device}")
        counts = tuple(int(c) for c in host_counts.tolist())
    m, topk = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    local = (ids >= 0) & (ids < num_local_experts)
    key = torch.where(local, ids, num_local_experts)  # pairs of other ranks' experts sort last
    # a radix sort makes one pass per key byte: 16-bit keys take 2 passes instead of 8 (on an
    # H200 the int64 sort was 18% of a thin expert layer's GPU time, in 8 kernel launches)
    key_dtype = torch.int16 if num_local_experts < 2**15 - 1 else torch.int32
    sorted_key, order = torch.sort(key.to(key_dtype), stable=True)
    if counts is None:
        bounds = torch.arange(1, num_local_experts + 1, device=device, dtype=key_dtype)
        offsets = torch.searchsorted(sorted_key, bounds).to(torch.int32)
        num_rows = m * topk
        tokens = torch.where(sorted_key < num_local_experts, order // topk, 0)
    else:
        offsets = _offsets_from_host(counts, device)
        num_rows = sum(counts)
        tokens = order[:num_rows] // topk
    rows = torch.empty_like(order)
    rows.scatter_(0, order, torch.arange(m * topk, device=device, dtype=torch.int64))
    slot_rows = torch.where(local, rows, 0).view(m, topk)
    return ExpertGroups(tokens=tokens, offsets=offsets, slot_rows=slot_rows,
                        local=local.view(m, topk), num_rows=num_rows, host_counts=counts)
