"""A transformers experts module's own forward as dbo experts, for expert-parallel models.

:class:`ModelExperts` runs what the backend delivered through the experts module transformers
loaded (whatever ``experts_implementation``), on this rank's local expert ids, in both
activation formats; :mod:`dbo.integrations.hf_ep` builds one per experts module. Under FSDP2
the module's parameters are DTensors swapped around each call; :func:`_local_params` swaps them
where the experts read them, since under DBO one call spans yields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dbo.errors import DBOError
from dbo.moe import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEExperts,
    TopKWeightAndReduce,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    Workspace,
)
from dbo.moe.experts import dequantize_blocks

__all__ = ["UnsupportedEPError", "ModelExperts"]


class UnsupportedEPError(DBOError, ValueError):
    """transformers laid the experts out in a way dbo's implementations cannot run."""


@contextlib.contextmanager
def _local_params(module: torch.nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local tensors for the block (no yield inside).

    transformers swaps them around the whole implementation call, but under DBO that call spans
    yields: the ubatch that leaves first swaps the DTensors back while the other is still
    inside, so the experts swap them again right where they read them."""
    from torch.distributed.tensor import DTensor

    params = module._parameters
    originals = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    params.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        params.update(originals)


class ModelExperts(MoEExperts):
    """A transformers experts module's own forward as :class:`dbo.moe.MoEExperts`.

    The forward ``f(x [N, hidden], ids [N, k], weights [N, k]) -> [N, hidden]`` takes local
    expert ids, with ``num_local_experts`` for "no expert here" (transformers' sentinel), and
    weighs and sums over ``k`` itself. It reads the module's weights when it runs, so ``w1`` /
    ``w2`` of :meth:`apply` are ignored (placeholders). STANDARD format: one row per received token,
    reduced here. BATCHED_EXPERTS format (deepep_ll): each expert's slab becomes rows of that
    expert with weight 1, the rows past its count get the sentinel; finalize weighs them.

    Args:
        module: the experts module (``num_experts`` = its local expert count).
        forward: its forward (captured before transformers replaces ``module.forward``).
    """

    def __init__(self, module: torch.nn.Module, forward: Any):
        self.module = module
        self.forward = forward
        if hasattr(module, "_is_expert_parallel"):
            # the sentinel ids this class passes are masked by transformers' experts
            # implementations only in expert-parallel mode: grouped_mm leaves the sentinel rows of
            # its output unwritten otherwise, and weight 0 times an unwritten NaN is NaN
            module._is_expert_parallel = True
        self.num_local_experts = int(module.num_experts)
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        return TopKWeightAndReduceNoOp()

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        with _local_params(self.module):
            local = next(iter(self.module.parameters()), None)
            if local is not None and local.dim() == 3 and local.shape[0] != self.num_local_experts:
                raise UnsupportedEPError(
                    f"the experts module holds {local.shape[0]} experts' weights on this rank, not its "
                    f"{self.num_local_experts}: dbo's implementations need every expert whole on one "
                    "rank (ep_size == fsdp_size * tp_size)")
            return self.forward(x, ids, weights).to(x.dtype)

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None,
              topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None, *,
              activation_format: ActivationFormat, expert_tokens_meta: ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool, workspace: Workspace,
              a1q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`dbo.moe.MoEExperts.apply` (``w1``/``w2`` unused)."""
        del w1, w2, workspace
        self._format = activation_format
        param = next(iter(self.module.parameters()), None)
        dtype = hidden_states.dtype if param is None or a1q_scale is None else param.dtype
        x = dequantize_blocks(hidden_states, a1q_scale, dtype)
        sentinel = self.num_local_experts
        if activation_format is ActivationFormat.BATCHED_EXPERTS:
            if expert_tokens_meta is None:
                raise ValueError("BATCHED_EXPERTS activations need expert_tokens_meta (rows per expert)")
            experts, rows, hidden = x.shape
            valid = (torch.arange(rows, device=x.device).unsqueeze(0)
                     < expert_tokens_meta.expert_num_tokens.to(x.device).unsqueeze(1))
            own = torch.arange(experts, device=x.device).unsqueeze(1).expand(experts, rows)
            ids = torch.where(valid, own, sentinel).reshape(-1, 1)
            out = self._run(x.reshape(-1, hidden), ids, valid.to(x.dtype).reshape(-1, 1))
            return out.view(experts, rows, hidden)
        if topk_ids is None or topk_weights is None:
            raise ValueError("STANDARD activations need topk_ids and topk_weights")
        mine = topk_ids >= 0
        ids = torch.where(mine, topk_ids, sentinel)
        weights = mine.to(x.dtype) if apply_router_weight_on_input else \
            torch.where(mine, topk_weights, 0.0).to(x.dtype)
        return self._run(x, ids, weights)
