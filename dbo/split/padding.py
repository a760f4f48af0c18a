"""Padding of split batches: the CUDA-graph size a split batch pads to, and padding rows that
route to no expert.

Every ubatch of a split plan has the same row count on every rank (the all-to-all shapes must
match). With captured CUDA-graph sizes, that count comes from the smallest captured size of the
whole batch that holds the group's largest ubatch, as vLLM pads to its capture sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["graph_padded_size", "mask_padding_routing"]


def graph_padded_size(rows_per_ubatch: int, num_ubatches: int, cudagraph_sizes: Sequence[int]) -> int | None:
    """The smallest captured whole-batch size ``P`` in ``cudagraph_sizes`` that is a multiple of
    ``num_ubatches`` and gives each ubatch ``P // num_ubatches >= rows_per_ubatch`` rows; None
    when no captured size is that large (the step then runs eagerly, unpadded past its rows)."""
    fits = [int(p) for p in cudagraph_sizes
            if int(p) % num_ubatches == 0 and int(p) // num_ubatches >= rows_per_ubatch]
    return min(fits, default=None)


def mask_padding_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         num_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Route rows ``num_valid:`` to no expert: ``topk_ids`` -1 and ``topk_weights`` 0.

    Args:
        topk_ids: ``[num_rows, topk]`` integer expert ids.
        topk_weights: ``[num_rows, topk]`` float weights.
        num_valid: real rows (the first ones), e.g. ``plan.num_valid(i)``.
    Returns:
        New ``(topk_ids, topk_weights)``; the inputs are not modified. No host sync.
    """
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must have the same shape")
    if num_valid >= topk_ids.shape[0]:
        return topk_ids, topk_weights
    valid = (torch.arange(topk_ids.shape[0], device=topk_ids.device) < num_valid).unsqueeze(1)
    ids = torch.where(valid, topk_ids, torch.full_like(topk_ids, -1))
    weights = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
    return ids, weights
