"""Token-exact expert-parallel backend on ``all_to_all_single``.

Each token goes once to every rank that holds at least one of its experts (never to the
others), with its full routing row; each receiving rank computes its local experts' weighted
sum for the token and sends that partial sum back; the owner adds the partial sums. Works under
gloo (CPU) and NCCL.

Per call: one blocking metadata all-gather (every rank's send counts, which give each rank its
receive counts, plus the cross-rank argument check), one all-to-all of the packed rows
(tokens, ids, weights) for dispatch, one all-to-all of the partial sums for combine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dbo.moe.base import (
    PrepareResult,
    TopKWeightAndReduce,
)
from dbo.moe.handles import PerUBatch

from .torchdist import (
    PendingWork,
    TorchDistPrepareAndFinalize,
    factory_for,
    pack_rows,
    unpack_rows,
)

__all__ = ["AllToAllPrepareAndFinalize", "make_prepare_finalize"]

logger = logging.getLogger(__name__)


@dataclass
class _A2AHandle:
    send_idx: torch.Tensor      # [S] int64: local token of each row sent, grouped by destination
    send_counts: list[int]      # rows sent to each rank
    recv_counts: list[int]      # rows received from each rank
    num_tokens: int
    hidden: int
    total: int                  # rows dispatched over the whole group (0: skip the combine)


class AllToAllPrepareAndFinalize(TorchDistPrepareAndFinalize):
    """Token-exact dispatch and combine with ``all_to_all_single`` (STANDARD format).

    ``prepare`` returns ``a1q`` ``[M_recv, hidden]``: the tokens of rank 0 that hit this rank's
    experts, then rank 1's, ...; ``topk_ids`` ``[M_recv, topk]`` local ids (``-1`` for experts
    elsewhere) and ``topk_weights`` float32. Experts are placed contiguously (rank ``r`` holds
    ``[r * L, (r + 1) * L)``); an ``expert_map`` must describe that placement.
    Constructor arguments: see :class:`TorchDistPrepareAndFinalize`.
    """

    name = "all2all"

    def __init__(self, group: Any = None, **kwargs: Any):
        super().__init__(group, **kwargs)
        self._handles: PerUBatch[_A2AHandle] = PerUBatch("all2all dispatch handle")

    def reset(self) -> None:
        self._handles.clear()

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        n_local = self._check(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input)
        self._check_expert_map(expert_map, num_experts)
        x = self._router_on_input(a1, topk_weights, apply_router_weight_on_input)
        m, hidden = x.shape
        topk = topk_ids.shape[1]
        ws = self.world_size
        ids = topk_ids.to(torch.int64)
        # destination ranks of each token; -1 slots go to a dummy column that is dropped
        owner = torch.where(ids >= 0, ids // n_local, ws)
        dest = torch.zeros(m, ws + 1, dtype=torch.bool, device=x.device)
        dest.scatter_(1, owner, True)
        dest = dest[:, :ws]
        pairs = torch.nonzero(dest.t())  # (rank, token), grouped by rank, tokens ascending
        send_idx = pairs[:, 1]
        send_counts = dest.sum(0).tolist()
        send = pack_rows(x[send_idx], topk_ids[send_idx].to(torch.int32), topk_weights[send_idx])
        # the count exchange blocks the CPU: yield first, so the other ubatch queues its compute
        with self.comm_section(back="plain", enabled=self.nccl) as comm:
            rows = self._exchange_meta(x, topk, num_experts, apply_router_weight_on_input,
                                       extra=send_counts)
            recv_counts = [r.extra[self.rank] for r in rows]  # what each rank sends here
            total = sum(sum(r.extra) for r in rows)
            self._handles.put(_A2AHandle(send_idx, send_counts, recv_counts, m, hidden, total))
            recv = torch.empty(sum(recv_counts), send.shape[1], dtype=torch.uint8, device=send.device)
            work = None
            if total:
                work = self._start(lambda out, inp: dist.all_to_all_single(
                    out, inp, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                    group=self.group, async_op=True), recv, send)
            pending = PendingWork([work], self._what("dispatch all-to-all"), self.timeout_s, self.nccl)
            comm.keep(send)
            comm.keep_for_compute(recv)
        lo = self.rank * n_local

        def receiver() -> PrepareResult:
            pending.wait()
            xr, idr, wr = unpack_rows(recv, [(hidden, x.dtype), (topk, torch.int32),
                                             (topk, torch.float32)])
            idr = idr.to(torch.int64)
            local = torch.where((idr >= lo) & (idr < lo + n_local), idr - lo, -1)
            return PrepareResult(xr, None, None, local, wr)

        return self._async_result(pending, receiver)

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce: TopKWeightAndReduce):
        h = self._handles.take()
        y = self._weighted_output(output, h.num_tokens, h.hidden, fused_expert_output, topk_weights,
                                  topk_ids, apply_router_weight_on_input, weight_and_reduce)
        if y.shape[0] != sum(h.recv_counts):
            raise ValueError(f"fused_expert_output reduces to {y.shape[0]} rows, but "
                             f"{sum(h.recv_counts)} were dispatched to this rank")
        with self.comm_section(yield_first=False, back="plain", enabled=self.nccl) as comm:
            back = torch.empty(h.send_idx.numel(), h.hidden, dtype=output.dtype, device=output.device)
            # a rank that sends and receives nothing still takes part: the collective is skipped
            # only when the whole group moved nothing, which every rank knows from prepare
            work = self._start(lambda out, inp: dist.all_to_all_single(
                out, inp, output_split_sizes=h.send_counts, input_split_sizes=h.recv_counts,
                group=self.group, async_op=True), back, y) if h.total else None
            pending = PendingWork([work], self._what("combine all-to-all"), self.timeout_s, self.nccl)
            comm.keep(y)
            comm.keep_for_compute(back)

        def receiver() -> None:
            pending.wait()
            acc = torch.zeros(h.num_tokens, h.hidden, dtype=torch.float32, device=output.device)
            acc.index_add_(0, h.send_idx, back.to(torch.float32))
            output.copy_(acc)

        return self._async_result(pending, receiver)


#: the registry's builder (:func:`dbo.backends.torchdist.factory_for`)
make_prepare_finalize = factory_for(AllToAllPrepareAndFinalize, "all2all")
