"""DeepEP v2 prepare/finalize over ``ElasticBuffer`` (DeepEP 2.0/2.1) or ``EPBuffer`` (later).

NOT VERIFIED ON A GPU: DeepEP v2 needs NCCL >= 2.30 with GPU-initiated networking, which the
project's GPU host lacks (see DESIGN.md). This backend is written against v2's documented Python
API; ``tests/test_deepep_v2_signatures.py`` checks every keyword it passes against the
signatures in ``tests/fixtures/deepep_v2_signatures.json`` (read from DeepEP's sources with
``ast``), and its logic is tested on CPU against ``dbo.testing.fake_deep_ep``.

Two modes, both STANDARD format:

* ``decode``: ``do_expand=False, do_cpu_sync=False``: no CPU sync, receive tensors sized for the
  worst case (capacity), rows past the received count masked (ids ``-1``, weights and tokens 0)
  on the device, so the step can be captured in a CUDA graph;
* ``prefill``: ``do_expand=True, do_cpu_sync=True``: one row per (token, local expert) pair,
  grouped by expert, exact sizes; ``topk_ids``/``topk_weights`` are ``[N, 1]``.

Under DBO the backend captures the compute stream's event (``capture``), yields, dispatches /
combines from the comm stream waiting on it (``allocate_on_comm_stream=True``, as v2 requires
with ``previous_event``), then switches back with a sync. Handles live per ubatch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    FinalizeAsyncResult,
    PrepareAsyncResult,
    PrepareResult,
)
from dbo.moe.weight_and_reduce import (
    TopKWeightAndReduce,
)

from .deepep.buffer import (
    BufferMode,
    DeepEPBufferCache,
    SharedDeepEPBuffer,
    get_deepep_buffer,
    round_up_hidden,
)
from .deepep.common import DeepEPPrepareAndFinalize, hand_to_current_stream
from .fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

__all__ = ["DeepEPV2PrepareAndFinalize", "V2_MODES", "expanded_row_experts", "make_prepare_finalize"]

logger = logging.getLogger(__name__)

_NAME = "deepep_v2"
V2_MODES = ("decode", "prefill")


def expanded_row_experts(psum_per_expert: torch.Tensor, num_rows: int, expert_alignment: int) -> torch.Tensor:
    """The local expert of each row of v2's expanded layout, ``-1`` for alignment padding.

    Args:
        psum_per_expert: ``[L]`` int, v2's ``psum_num_recv_tokens_per_expert`` in expand mode:
            entry ``e`` is expert ``e``'s aligned start plus its real count.
        num_rows: rows of the expanded receive tensor.
        expert_alignment: the alignment used by the dispatch.

    Returns:
        ``[num_rows]`` int64, computed on the device (no CPU sync).
    """
    psum = psum_per_expert.to(torch.int64)
    prev = torch.cat([psum.new_zeros(1), psum[:-1]])
    starts = (prev + expert_alignment - 1) // expert_alignment * expert_alignment
    rows = torch.arange(num_rows, device=psum.device, dtype=torch.int64)
    expert = torch.searchsorted(starts, rows, right=True) - 1
    valid = (expert >= 0) & (rows < psum[expert.clamp(min=0)])
    return torch.where(valid, expert, torch.full_like(expert, -1))


class DeepEPV2PrepareAndFinalize(DeepEPPrepareAndFinalize):
    """Prepare/finalize over DeepEP v2's ``dispatch``/``combine`` (STANDARD format).

    ``prepare`` delivers ``a1q`` ``[R, hidden]`` bf16 (fp8 plus scales if ``use_fp8_dispatch``
    and not ``dequantize_received``), ``topk_ids`` int64 LOCAL ids (``-1`` = none),
    ``topk_weights`` float32 and per-local-expert counts (``expert_num_tokens`` on the device):

    * decode: ``R`` = v2's capacity; rows at or past the received count have ids ``-1``,
      weights 0 and zero tokens; ``topk_ids`` ``[R, topk]``;
    * prefill: ``R`` = received (token, local expert) pairs, grouped by expert;
      ``topk_ids``/``topk_weights`` ``[R, 1]``.

    ``finalize`` weights and reduces the experts' output per row (``TopKWeightAndReduceContiguous``
    unless the experts did it) and combines (sums over ranks) into ``output`` ``[M, hidden]``.
    """

    def __init__(self, shared: SharedDeepEPBuffer, *, num_experts: int, hidden: int,
                 max_tokens_per_rank: int, mode: str = "decode", use_fp8_dispatch: bool = False,
                 dequantize_received: bool = True, expert_alignment: int = 1, timeout_s: float = 60.0):
        if mode not in V2_MODES:
            raise ValueError(f"{_NAME}: mode must be one of {V2_MODES}, got {mode!r}")
        super().__init__(shared, BufferMode.V2, _NAME, num_experts=num_experts, hidden=hidden,
                         use_fp8_dispatch=use_fp8_dispatch, dequantize_received=dequantize_received,
                         timeout_s=timeout_s)
        self.padded_hidden = round_up_hidden(
            hidden, torch.float8_e4m3fn if use_fp8_dispatch else torch.bfloat16)
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.mode = mode
        self.expert_alignment = int(expert_alignment)

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    # ---- prepare ---------------------------------------------------------------------------

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: torch.Tensor | None,
                      apply_router_weight_on_input: bool, quant_config: Any = None) -> PrepareAsyncResult:
        x, topk_weights, topk_ids = self._padded_input(a1, topk_weights, topk_ids, num_experts,
                                                       expert_map, apply_router_weight_on_input)
        if self.use_fp8_dispatch:
            x = quantize_fp8_blocks(x)
        expand = self.mode == "prefill"
        buffer = self.buffer
        with self.comm_section(capture=buffer.capture, back="sync") as comm:
            dbo, previous_event = comm.in_run, comm.previous_event
            seq = self._arrive("dispatch")

            # with do_cpu_sync the dispatch waits on the host holding the GIL (as deepep_ht's does)
            def dispatch() -> tuple:
                return buffer.dispatch(
                    x=x,
                    topk_idx=topk_ids,
                    topk_weights=topk_weights,
                    num_experts=self.num_experts,
                    num_max_tokens_per_rank=self.max_tokens_per_rank,
                    expert_alignment=self.expert_alignment,
                    previous_event=previous_event,
                    async_with_compute_stream=not dbo,
                    allocate_on_comm_stream=previous_event is not None,
                    do_handle_copy=False,
                    do_cpu_sync=expand,
                    do_expand=expand,
                    do_zero_padding=expand and self.expert_alignment > 1,
                )

            recv_x, recv_topk_ids, recv_topk_weights, handle, event = (
                self._host_wait("dispatch", dispatch) if expand else dispatch())
            # topk_ids is stored by reference in the handle and must outlive it
            self._handles.put((handle, topk_ids))
            if dbo:
                self._watch("dispatch", seq, a1.device)

        def receiver() -> PrepareResult:
            if not dbo:
                event.current_stream_wait()
                self._watch("dispatch", seq, a1.device)
            q, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            hand_to_current_stream((q, scale, recv_topk_ids, recv_topk_weights))
            if scale is not None and self.dequantize_received:
                q, scale = dequantize_fp8_blocks(q, scale), None
            if expand:
                ids, weights, meta = self._expanded_routing(handle, q.shape[0], recv_topk_weights)
            else:
                ids, weights, meta, q = self._masked_routing(handle, q, recv_topk_ids, recv_topk_weights)
            return PrepareResult(q[:, : self.hidden], scale, meta, ids, weights)

        return receiver

    def _masked_routing(self, handle: Any, q: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ExpertTokensMetadata,
                                                        torch.Tensor]:
        # Rows at or past the received count are uninitialised: mask them on the device.
        num_recv = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
        pad = torch.arange(q.shape[0], device=q.device) >= num_recv.to(q.device)
        ids = ids.masked_fill(pad.unsqueeze(1), -1)
        weights = weights.masked_fill(pad.unsqueeze(1) | (ids < 0), 0.0)
        if q.dtype != torch.float8_e4m3fn:
            q = q.masked_fill(pad.unsqueeze(1), 0)
        psum = handle.psum_num_recv_tokens_per_expert.to(torch.int64)
        counts = torch.diff(psum, prepend=psum.new_zeros(1)).to(torch.int32)
        return ids, weights, ExpertTokensMetadata(counts, None), q

    def _expanded_routing(self, handle: Any, num_rows: int, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, ExpertTokensMetadata]:
        experts = expanded_row_experts(handle.psum_num_recv_tokens_per_expert, num_rows,
                                       self.expert_alignment)
        ids = experts.unsqueeze(1)
        w = weights.reshape(-1)[:num_rows].to(torch.float32).unsqueeze(1)
        w = w.masked_fill(ids < 0, 0.0)
        counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int32)
        cpu = (torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int32)
               if self.expert_alignment == 1 else None)
        return ids, w, ExpertTokensMetadata(counts, cpu)

    # ---- finalize --------------------------------------------------------------------------

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce: TopKWeightAndReduce) -> FinalizeAsyncResult:
        handle, _dispatched_ids = self._handles.take("finalize")
        x = self._reduced_input(output, fused_expert_output, topk_weights, topk_ids,
                                apply_router_weight_on_input, weight_and_reduce)
        buffer = self.buffer
        with self.comm_section(capture=buffer.capture, back="sync") as comm:
            seq = self._arrive("combine")
            combined, _, event = buffer.combine(x=x, handle=handle, topk_weights=None,
                                                previous_event=comm.previous_event,
                                                async_with_compute_stream=not comm.in_run,
                                                allocate_on_comm_stream=comm.in_run)
            if comm.in_run:
                output.copy_(combined[:, : self.hidden])
                self._watch("combine", seq, output.device)
        if comm.in_run:
            return _done

        def receiver() -> None:
            event.current_stream_wait()
            output.copy_(combined[:, : self.hidden])
            self._watch("combine", seq, output.device)

        return receiver


def _done() -> None:
    return None


def make_prepare_finalize(
    group: Any,
    *,
    hidden: int,
    max_tokens_per_rank: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    mode: str = "decode",
    use_fp8_dispatch: bool = False,
    dequantize_received: bool = True,
    expert_alignment: int = 1,
    timeout_s: float = 60.0,
    cache: DeepEPBufferCache | None = None,
) -> DeepEPV2PrepareAndFinalize:
    """Build a :class:`DeepEPV2PrepareAndFinalize` (``mode`` ``"decode"`` or ``"prefill"``) on
    ``group``'s shared v2 buffer. Collective on first use; ``dtype`` must be bf16."""
    if dtype != torch.bfloat16:
        raise TypeError(f"{_NAME}: DeepEP v2's combine is bf16 only, got dtype={dtype}")
    del device
    padded = round_up_hidden(hidden, torch.float8_e4m3fn if use_fp8_dispatch else torch.bfloat16)
    shared = get_deepep_buffer(group, mode=BufferMode.V2, hidden=padded,
                               max_tokens_per_rank=max_tokens_per_rank, num_experts=num_experts,
                               topk=topk, use_fp8_dispatch=use_fp8_dispatch, cache=cache)
    return DeepEPV2PrepareAndFinalize(shared, num_experts=num_experts, hidden=hidden,
                                      max_tokens_per_rank=max_tokens_per_rank, mode=mode,
                                      use_fp8_dispatch=use_fp8_dispatch,
                                      dequantize_received=dequantize_received,
                                      expert_alignment=expert_alignment, timeout_s=timeout_s)
