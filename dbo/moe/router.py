"""Top-k router: softmax over expert logits, keep the k largest, optionally renormalize."""

from __future__ import annotations

import torch

__all__ = ["topk_route", "TopKRouter"]


def topk_route(
    router_logits: torch.Tensor,
    topk: int,
    *,
    renormalize: bool = True,
    ids_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``topk`` experts per token.

    Args:
        router_logits: ``[M, num_experts]`` any float dtype.
        topk: experts per token, ``1 <= topk <= num_experts``.
        renormalize: rescale the kept probabilities to sum to 1 per token.
        ids_dtype: int32 (default) or int64.

    Returns:
        ``(topk_weights [M, topk] float32, topk_ids [M, topk] ids_dtype)``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [num_tokens, num_experts], got shape "
                         f"{tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    if ids_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
    probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(ids_dtype)


class TopKRouter:
    """A linear gate followed by :func:`topk_route`.

    Args:
        gate_weight: ``[num_experts, hidden]``, the activations' dtype.
        topk, renormalize, ids_dtype: as in :func:`topk_route`.
    """

    def __init__(self, gate_weight: torch.Tensor, topk: int, *, renormalize: bool = True,
                 ids_dtype: torch.dtype = torch.int32):
        if gate_weight.dim() != 2:
            raise ValueError(f"gate_weight must be [num_experts, hidden], got shape "
                             f"{tuple(gate_weight.shape)}")
        self.gate_weight = gate_weight
        self.topk = topk
        self.renormalize = renormalize
        self.ids_dtype = ids_dtype

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states`` ``[M, hidden]`` -> ``(topk_weights [M, topk] float32, topk_ids)``."""
        logits = hidden_states @ self.gate_weight.t()
        return topk_route(logits, self.topk, renormalize=self.renormalize, ids_dtype=self.ids_dtype)
