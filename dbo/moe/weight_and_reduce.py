"""How expert outputs become one row per token: apply the router weights and sum over top-k.

Experts either do this themselves (their output is already ``[M, hidden]``) or leave it to
``finalize``; :meth:`dbo.moe.MoEExperts.finalize_weight_and_reduce_impl` says which, with one of
the variants here. Same roles as the classes of the same names in vLLM's modular MoE kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = [
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNoOp",
    "TopKWeightAndReduceDelegate",
]


class TopKWeightAndReduce(ABC):
    """Turns the experts' output into ``[M, hidden]`` rows, one per (received) token."""

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Weight and reduce ``fused_expert_output`` into ``output`` (allocated if None).

        Args:
            output: ``[M, hidden]`` destination, or None to allocate one.
            fused_expert_output: the experts' output (layout depends on the variant).
            topk_weights: ``[M, topk]`` float32 router weights.
            topk_ids: ``[M, topk]`` int32/int64 expert ids; ``-1`` marks a slot whose expert
                is not here (its contribution is ignored).
            apply_router_weight_on_input: the weights were already applied to the input.

        Returns:
            ``[M, hidden]``: ``output`` itself if it was given.
        """


class TopKWeightAndReduceNoOp(TopKWeightAndReduce):
    """The experts already weighted and reduced: ``fused_expert_output`` is ``[M, hidden]``."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        if output is None:
            return fused_expert_output
        if output.data_ptr() != fused_expert_output.data_ptr():
            output.copy_(fused_expert_output)
        return output

    def __repr__(self) -> str:
        return "TopKWeightAndReduceNoOp()"


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """``fused_expert_output`` is ``[M, topk, hidden]`` (or ``[M * topk, hidden]``), unweighted.

    Slots whose ``topk_ids`` entry is negative contribute nothing, whatever their rows hold.
    The weighted sum is accumulated in float32 and cast to ``output``'s dtype.
    """

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        m, topk = topk_ids.shape
        hidden = fused_expert_output.shape[-1]
        if fused_expert_output.numel() != m * topk * hidden:
            raise ValueError(
                f"fused_expert_output has shape {tuple(fused_expert_output.shape)}, expected "
                f"[{m}, {topk}, {hidden}] (or [{m * topk}, {hidden}]) for topk_ids of shape "
                f"{tuple(topk_ids.shape)}"
            )
        y = fused_expert_output.reshape(m, topk, hidden)
        valid = (topk_ids >= 0).to(torch.float32)
        w = valid if apply_router_weight_on_input else topk_weights.to(torch.float32) * valid
        reduced = torch.bmm(w.unsqueeze(1), y.to(torch.float32)).squeeze(1)
        if output is None:
            return reduced.to(fused_expert_output.dtype)
        output.copy_(reduced)
        return output

    def __repr__(self) -> str:
        return "TopKWeightAndReduceContiguous()"


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """The experts leave the choice to ``finalize``, which replaces this with its own variant.

    Calling :meth:`apply` on it is a bug in the prepare/finalize backend.
    """

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        raise RuntimeError(
            "TopKWeightAndReduceDelegate.apply was called: the prepare/finalize backend must "
            "replace the delegate with its own TopKWeightAndReduce in finalize"
        )

    def __repr__(self) -> str:
        return "TopKWeightAndReduceDelegate()"
