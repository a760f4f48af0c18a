"""A single-rank prepare/finalize (no expert parallelism), in both activation formats: backend
``local`` of the registry (:func:`make_prepare_finalize`), for a group of one rank.

Useful to run :class:`dbo.moe.MoEKernel` without a process group, to test experts in the
BATCHED_EXPERTS layout, and as the simplest example of the backend protocol: its async variant
returns ``(hook, receiver)`` pairs whose hooks do nothing but mark where a real backend waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)
from dbo.moe.handles import PerUBatch
from dbo.moe.validate import IdsRangeCheck, check_routing_inputs
from dbo.peers.groups import group_size

__all__ = ["LocalPrepareAndFinalize", "make_prepare_finalize"]


@dataclass
class _BatchedHandle:
    pairs: torch.Tensor     # [P] flat (token * topk + slot) index of each packed row
    experts: torch.Tensor   # [P] local expert of each packed row
    rows: torch.Tensor      # [P] row within its expert's slab
    num_tokens: int


class LocalPrepareAndFinalize(PrepareAndFinalize):
    """All experts live on this process; ``expert_map`` (if given) picks the local ones.

    Args:
        activation_format: STANDARD (pass-through) or BATCHED_EXPERTS (pack tokens per expert).
        max_num_tokens: BATCHED_EXPERTS slab height (default: the number of tokens).
        use_async: implement ``prepare_async``/``finalize_async`` with no-op hooks.
    """

    def __init__(self, activation_format: ActivationFormat = ActivationFormat.STANDARD, *,
                 max_num_tokens: int | None = None, use_async: bool = True):
        self._format = activation_format
        self._max_tokens = max_num_tokens
        self._use_async = use_async
        self._handles: PerUBatch[_BatchedHandle] = PerUBatch("local batched handle")
        self._ids_check = IdsRangeCheck()

    @property
    def activation_format(self) -> ActivationFormat:
        return self._format

    def max_num_tokens_per_rank(self) -> int | None:
        return self._max_tokens

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        return False

    def supports_async(self) -> bool:
        return self._use_async

    def supports_expert_groups(self) -> bool:
        """BATCHED_EXPERTS with the async pair: a combine per group of local experts (the
        simplest example of :meth:`finalize_group_async`)."""
        return self._format is ActivationFormat.BATCHED_EXPERTS and self._use_async

    def reset(self) -> None:
        self._handles.clear()

    def _local_ids(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
        ids = topk_ids.to(torch.int64)
        if expert_map is None:
            return ids
        return torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(min=0)], -1)

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        check_routing_inputs(a1, topk_weights, topk_ids, num_experts,
                             check_ids_range=self._ids_check(topk_ids),
                             apply_router_weight_on_input=apply_router_weight_on_input)
        x = a1
        if apply_router_weight_on_input:
            x = (a1.to(torch.float32) * topk_weights).to(a1.dtype)
        ids = self._local_ids(topk_ids, expert_map)
        if self._format is ActivationFormat.STANDARD:
            res = PrepareResult(x, None, None, ids, topk_weights)
            return (lambda: None), (lambda: res)
        n_local = num_experts if expert_map is None else int((expert_map >= 0).sum())
        m, topk = ids.shape
        flat = ids.reshape(-1)
        pairs = torch.nonzero(flat >= 0).squeeze(1)
        experts = flat[pairs]
        counts = torch.bincount(experts, minlength=n_local)
        order = torch.argsort(experts, stable=True)
        pairs, experts = pairs[order], experts[order]
        starts = torch.cumsum(counts, 0) - counts
        rows = torch.arange(pairs.numel(), device=a1.device) - starts[experts]
        max_tokens = self._max_tokens if self._max_tokens is not None else max(m, 1)
        if counts.numel() and int(counts.max()) > max_tokens:
            raise ValueError(f"an expert received {int(counts.max())} tokens, more than "
                             f"max_num_tokens={max_tokens}")
        packed = torch.zeros(n_local, max_tokens, a1.shape[1], dtype=a1.dtype, device=a1.device)
        packed[experts, rows] = x[pairs // topk]
        self._handles.put(_BatchedHandle(pairs, experts, rows, m))
        meta = ExpertTokensMetadata(counts.to(torch.int32), counts.to(torch.int32).cpu())
        res = PrepareResult(packed, None, meta, None, None)
        return (lambda: None), (lambda: res)

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce: TopKWeightAndReduce):
        if self._format is ActivationFormat.STANDARD:
            if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
                weight_and_reduce = TopKWeightAndReduceContiguous()
            weight_and_reduce.apply(output, fused_expert_output, topk_weights, topk_ids,
                                    apply_router_weight_on_input)
            return (lambda: None), (lambda: None)
        self._combine(self._handles.take(), output, fused_expert_output, topk_weights, topk_ids,
                      apply_router_weight_on_input, None)
        return (lambda: None), (lambda: None)

    def finalize_group_async(self, output, fused_expert_output, topk_weights, topk_ids,
                             apply_router_weight_on_input, weight_and_reduce: TopKWeightAndReduce, *,
                             experts: tuple[int, int], last: bool):
        """One group's combine: ``output`` gets the weighted sum over the slots whose local
        expert is in ``experts`` (``start, stop``); the dispatch's handle is kept until ``last``."""
        if not self.supports_expert_groups():
            raise NotImplementedError("per-group combines need BATCHED_EXPERTS and the async pair")
        h = self._handles.take() if last else self._handles.peek()
        if h is None:
            raise ValueError("finalize_group_async called with no prepare before it")
        self._combine(h, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                      experts)
        return (lambda: None), (lambda: None)

    @staticmethod
    def _combine(h: _BatchedHandle, output: torch.Tensor, fused: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, router_on_input: bool, experts: tuple[int, int] | None) -> None:
        # output = the weighted sum of each token's rows (of the experts in ``experts`` only)
        keep = slice(None) if experts is None else (h.experts >= experts[0]) & (h.experts < experts[1])
        pairs = h.pairs[keep]
        y = fused[h.experts[keep], h.rows[keep]].to(torch.float32)
        if not router_on_input:
            y = y * topk_weights.reshape(-1)[pairs].unsqueeze(1)
        acc = torch.zeros(h.num_tokens, output.shape[1], dtype=torch.float32, device=output.device)
        acc.index_add_(0, pairs // topk_ids.shape[1], y)
        output.copy_(acc)


def make_prepare_finalize(group: Any = None, *, hidden: int, max_tokens_per_rank: int | None = None,
                          num_experts: int, topk: int, dtype: torch.dtype = torch.float32,
                          device: torch.device | str | None = None,
                          activation_format: ActivationFormat | str = ActivationFormat.STANDARD,
                          use_async: bool = True) -> LocalPrepareAndFinalize:
    """Build a :class:`LocalPrepareAndFinalize` (the registry's one way to build a backend).

    Args:
        group: None, or a process group of one rank: every expert lives on this process.
        max_tokens_per_rank: the most tokens in one call: the BATCHED_EXPERTS slab height (an
            expert receives at most every token); None: each call's number of tokens.
        hidden, num_experts, topk, dtype, device: unused (nothing is allocated ahead, any dtype
            moves).
        activation_format: STANDARD or BATCHED_EXPERTS (the enum or its value, ``"standard"``,
            ``"batched_experts"``).
        use_async: implement ``prepare_async``/``finalize_async`` with no-op hooks.

    Raises:
        ValueError: a group of more than one rank (nothing would reach the other ranks' experts),
            or an unknown ``activation_format``.
    """
    del hidden, num_experts, topk, dtype, device
    ranks = group_size(group)
    if ranks != 1:
        raise ValueError(f"backend 'local' runs on one rank (every expert on this process); the group "
                         f"has {ranks} ranks: use an expert-parallel backend there")
    try:
        fmt = ActivationFormat(activation_format)
    except ValueError:
        raise ValueError(f"activation_format must be one of {[f.value for f in ActivationFormat]}, "
                         f"got {activation_format!r}") from None
    return LocalPrepareAndFinalize(fmt, max_num_tokens=max_tokens_per_rank, use_async=use_async)
