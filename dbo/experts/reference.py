"""A single-process MoE that tests trust: every (token, expert) pair computed one at a time.

Also the helpers the tests and examples share: random expert weights, the slice of them a rank
holds, and the relative error used as the match criterion.
"""

from __future__ import annotations

import torch

from dbo.experts.swiglu import swiglu_expert

__all__ = ["reference_moe", "make_expert_weights", "local_expert_weights", "relative_error"]


def reference_moe(
    x: torch.Tensor,
    w1_all: torch.Tensor,
    w2_all: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    apply_router_weight_on_input: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Routed-experts output computed in float32, token by token.

    Args:
        x: ``[M, hidden]``.
        w1_all: ``[num_experts, 2 * intermediate, hidden]``.
        w2_all: ``[num_experts, hidden, intermediate]``.
        topk_weights: ``[M, topk]`` float32.
        topk_ids: ``[M, topk]`` global expert ids, ``-1`` skipped.
        apply_router_weight_on_input: scale the input (not the output) by the weight.
        out_dtype: result dtype (default ``x.dtype``).

    Returns:
        ``[M, hidden]``.
    """
    xf = x.to(torch.float32)
    w1f = w1_all.to(torch.float32)
    w2f = w2_all.to(torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.tolist()
    weights = topk_weights.to(torch.float32)
    for t, row in enumerate(ids):
        for k, e in enumerate(row):
            if e < 0:
                continue
            w = weights[t, k]
            if apply_router_weight_on_input:
                out[t] += swiglu_expert(xf[t:t + 1] * w, w1f[e], w2f[e])[0]
            else:
                out[t] += w * swiglu_expert(xf[t:t + 1], w1f[e], w2f[e])[0]
    return out.to(out_dtype or x.dtype)


def make_expert_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random SwiGLU weights scaled so activations stay O(1).

    Returns ``(w1 [num_experts, 2 * intermediate, hidden], w2 [num_experts, hidden,
    intermediate])`` of ``dtype``; the same ``seed`` gives the same weights on every rank.
    """
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    return w1.to(dtype=dtype, device=device), w2.to(dtype=dtype, device=device)


def local_expert_weights(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of the expert dim of ``w`` ``[num_experts, ...]``."""
    if w.shape[0] % world_size:
        raise ValueError(f"{w.shape[0]} experts do not split evenly over {world_size} ranks")
    n = w.shape[0] // world_size
    return w[rank * n:(rank + 1) * n].contiguous()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are empty or ``ref`` is all zero
    and ``out`` equals it)."""
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    diff = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / den
