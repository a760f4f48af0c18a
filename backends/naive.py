"""Naive expert-parallel backend: all-gather every token, reduce-scatter the outputs.

Every rank receives every rank's tokens (padded to the largest rank's count), computes the
contribution of its local experts to all of them, and a reduce-scatter sums the contributions
and hands each rank back its own rows. Simple and exact; moves ``world_size`` times more data
than :mod:`dbo.backends.all2all`. Works under gloo (CPU) and NCCL.

Per call: one blocking metadata all-gather (token counts, and a check that every rank passed the
same hidden size, dtype, topk and expert count), one all-gather of the packed rows, one
reduce-scatter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dbo.moe.base import (
    PrepareResult,
    TopKWeightAndReduce,
)
from dbo.moe.handles import PerUBatch

from .torchdist import (
    PendingWork,
    TorchDistPrepareAndFinalize,
    all_gather_single,
    factory_for,
    pack_rows,
    reduce_scatter_single,
    unpack_rows,
)

__all__ = ["NaivePrepareAndFinalize", "make_prepare_finalize"]

logger = logging.getLogger(__name__)


@dataclass
class _NaiveHandle:
    num_tokens: int        # this rank's rows
    max_tokens: int        # rows per rank after padding
    hidden: int
    dtype: torch.dtype


class NaivePrepareAndFinalize(TorchDistPrepareAndFinalize):
    """All-gather dispatch, reduce-scatter combine (STANDARD format).

    ``prepare`` returns ``a1q`` ``[world_size * max_tokens, hidden]`` (rank ``r``'s tokens at
    rows ``[r * max_tokens, r * max_tokens + count_r)``, padding rows after them route to no
    expert), ``topk_ids`` in local ids (``-1`` for other ranks' experts and for padding) and
    ``topk_weights`` float32. ``expert_map`` may place experts arbitrarily (it maps global ids
    to this rank's local ids); without it the contiguous placement is used.
    Constructor arguments: see :class:`TorchDistPrepareAndFinalize`.
    """

    name = "naive"

    def __init__(self, group: Any = None, **kwargs: Any):
        super().__init__(group, **kwargs)
        self._handles: PerUBatch[_NaiveHandle] = PerUBatch("naive dispatch handle")

    def reset(self) -> None:
        self._handles.clear()

    def _local_ids(self, ids: torch.Tensor, num_experts: int, n_local: int,
                   expert_map: torch.Tensor | None) -> torch.Tensor:
        ids = ids.to(torch.int64)
        valid = ids >= 0
        if expert_map is not None:
            if expert_map.shape != (num_experts,):
                raise ValueError(f"expert_map must be [num_experts={num_experts}], got shape "
                                 f"{tuple(expert_map.shape)}")
            local = expert_map.to(device=ids.device, dtype=torch.int64)[ids.clamp(min=0)]
            return torch.where(valid, local, -1)
        lo = self.rank * n_local
        mine = valid & (ids >= lo) & (ids < lo + n_local)
        return torch.where(mine, ids - lo, -1)

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        n_local = self._check(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input)
        x = self._router_on_input(a1, topk_weights, apply_router_weight_on_input)
        m, hidden = x.shape
        topk = topk_ids.shape[1]
        # the count exchange blocks the CPU: yield first, so the other ubatch queues its compute
        with self.comm_section(back="plain", enabled=self.nccl) as comm:
            rows = self._exchange_meta(x, topk, num_experts, apply_router_weight_on_input)
            max_m = max(r.num_tokens for r in rows)
            self._handles.put(_NaiveHandle(m, max_m, hidden, x.dtype))
            ids = topk_ids.to(torch.int32)
            w = topk_weights
            if max_m > m:
                pad = max_m - m
                x = torch.cat([x, x.new_zeros(pad, hidden)])
                ids = torch.cat([ids, ids.new_full((pad, topk), -1)])
                w = torch.cat([w, w.new_zeros(pad, topk)])
            send = pack_rows(x, ids, w)
            recv = torch.empty(self.world_size * max_m, send.shape[1], dtype=torch.uint8,
                               device=send.device)
            work = None
            if max_m:
                work = self._start(lambda out, inp: all_gather_single(out, inp, self.group,
                                                                      async_op=True), recv, send)
            pending = PendingWork([work], self._what("dispatch all-gather"), self.timeout_s, self.nccl)
            comm.keep(x, send)
            comm.keep_for_compute(recv)

        def receiver() -> PrepareResult:
            pending.wait()
            xr, idr, wr = unpack_rows(recv, [(hidden, x.dtype), (topk, torch.int32),
                                             (topk, torch.float32)])
            local = self._local_ids(idr, num_experts, n_local, expert_map)
            return PrepareResult(xr, None, None, local, wr)

        return self._async_result(pending, receiver)

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce: TopKWeightAndReduce):
        h = self._handles.take()
        y = self._weighted_output(output, h.num_tokens, h.hidden, fused_expert_output, topk_weights,
                                  topk_ids, apply_router_weight_on_input, weight_and_reduce)
        with self.comm_section(yield_first=False, back="plain", enabled=self.nccl) as comm:
            mine = torch.empty(h.max_tokens, h.hidden, dtype=output.dtype, device=output.device)
            work = None
            if h.max_tokens:
                work = self._start(lambda out, inp: reduce_scatter_single(out, inp, self.group,
                                                                          async_op=True), mine, y)
            pending = PendingWork([work], self._what("combine reduce-scatter"), self.timeout_s,
                                  self.nccl)
            comm.keep(y)
            comm.keep_for_compute(mine)

        def receiver() -> None:
            pending.wait()
            output.copy_(mine[:h.num_tokens])

        return self._async_result(pending, receiver)


#: the registry's builder (:func:`dbo.backends.torchdist.factory_for`)
make_prepare_finalize = factory_for(NaivePrepareAndFinalize, "naive")
