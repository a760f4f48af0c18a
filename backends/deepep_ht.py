"""DeepEP high-throughput (normal mode) prepare/finalize: ``get_dispatch_layout`` + ``dispatch``
+ ``combine`` of ``deep_ep.Buffer``.

Normal-mode dispatch blocks the CPU until the receive counts arrive. Under DBO the backend
therefore captures an event on the compute stream (``dbo_get_previous_event(Buffer.capture)``),
yields so that the other ubatch queues its compute first, and only then launches the layout and
dispatch kernels from the comm stream, waiting on that event; then it switches back to the
compute stream with a sync. Combine does the same up to the switch back, which does not wait:
its receiver makes the compute stream wait for the combine, so a shared expert queued between
``finalize_async`` and the receiver runs alongside the combine. Without DBO, dispatch and
combine run with ``async_finish`` and the receivers wait on DeepEP's events.

Handles live per ubatch. Hidden sizes are padded to DeepEP's 512-byte transfer atom on the way
out and the padding stripped on the way back. Combine is bf16 only (checked). With
``use_fp8_dispatch`` the tokens travel as fp8 with one float32 scale per 128 elements.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dbo.moe.base import (
    ActivationFormat,
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
from .deepep.common import (
    DeepEPPrepareAndFinalize,
    expert_tokens_meta_from_list,
    hand_to_current_stream,
)
from .fp8 import FP8_BLOCK, dequantize_fp8_blocks, quantize_fp8_blocks

__all__ = ["DeepEPHTPrepareAndFinalize", "make_prepare_finalize"]

logger = logging.getLogger(__name__)

_NAME = "deepep_ht"


class DeepEPHTPrepareAndFinalize(DeepEPPrepareAndFinalize):
    """Prepare/finalize over DeepEP's normal (high-throughput) mode, STANDARD format.

    ``prepare`` delivers ``a1q`` ``[M_recv, hidden]`` (bf16; or fp8 with ``a1q_scale``
    ``[M_recv, hidden // 128]`` float32 if ``dequantize_received=False``), ``topk_ids``
    ``[M_recv, topk]`` int64 LOCAL expert ids (``-1`` = expert on another rank), ``topk_weights``
    ``[M_recv, topk]`` float32 (0 where the id is ``-1``) and per-local-expert counts. Received
    rows are ordered by source rank, then by token. ``finalize`` weights and reduces the experts'
    output over the local top-k (``TopKWeightAndReduceContiguous`` unless the experts did it),
    then combines (sums over ranks) into ``output`` ``[M, hidden]``.

    Args:
        shared: the group's normal-mode buffer (from :func:`get_deepep_buffer`).
        num_experts: global number of experts (a multiple of the group size).
        hidden: model hidden size (padded internally to whole 512-byte atoms).
        use_fp8_dispatch: quantize tokens to fp8 blocks of 128 before dispatch.
        dequantize_received: with fp8 dispatch, hand bf16 to the experts (default) instead of
            fp8 + scales.
        async_finish: without DBO, let the receivers wait on DeepEP's events (default True).
        expert_alignment: align each local expert's received count to this (DeepEP's option).
        timeout_s: the longest wait for the peers (see "Peer timeouts" in ``docs/backends.md``):
            before each dispatch/combine on the host (``CollectiveTimeoutError``), and for the
            launched kernels through the GPU watchdog (ends the process).
    """

    def __init__(self, shared: SharedDeepEPBuffer, *, num_experts: int, hidden: int,
                 use_fp8_dispatch: bool = False, dequantize_received: bool = True,
                 async_finish: bool = True, expert_alignment: int = 1, timeout_s: float = 60.0):
        super().__init__(shared, BufferMode.HIGH_THROUGHPUT, _NAME, num_experts=num_experts,
                         hidden=hidden, use_fp8_dispatch=use_fp8_dispatch,
                         dequantize_received=dequantize_received, timeout_s=timeout_s)
        # fp8 rows are 1 byte per element and need whole 128-element scale blocks
        self.padded_hidden = (round_up_hidden(hidden, torch.float8_e4m3fn) if use_fp8_dispatch
                              else round_up_hidden(hidden, torch.bfloat16))
        assert self.padded_hidden % FP8_BLOCK == 0 or not use_fp8_dispatch
        if self.padded_hidden > shared.request.hidden:
            raise ValueError(f"the shared buffer was sized for hidden {shared.request.hidden}, "
                             f"this backend needs {self.padded_hidden}")
        self.async_finish = async_finish
        self.expert_alignment = expert_alignment

    # ---- properties of the contract --------------------------------------------------------

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
        buffer = self.buffer
        config = buffer.get_dispatch_config(self.num_ranks)
        # Inside a run: the event covers exactly this ubatch's compute so far, and the ubatch
        # yields before the CPU-blocking dispatch so the other ubatch's compute is queued ahead
        with self.comm_section(capture=buffer.capture, back="sync") as comm:
            dbo = comm.in_run
            async_finish = self.async_finish and not dbo
            seq = self._arrive("dispatch")
            (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
             layout_event) = buffer.get_dispatch_layout(
                topk_ids, self.num_experts, previous_event=comm.previous_event, async_finish=async_finish,
                allocate_on_comm_stream=False)
            # DeepEP's dispatch waits on the host, holding the GIL, for the peers' GPUs to send
            # their counts: a peer whose GPU stalls would hold this rank there with no Python
            # thread (the GPU watchdog included) able to run; the GIL-free deadline ends the
            # process instead, the wait named in the stacks it writes
            recv_x, recv_topk_ids, recv_topk_weights, counts, handle, event = self._host_wait(
                "dispatch", lambda: buffer.dispatch(
                    x,
                    num_tokens_per_rank=num_tokens_per_rank,
                    num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                    is_token_in_rank=is_token_in_rank,
                    num_tokens_per_expert=num_tokens_per_expert,
                    topk_idx=topk_ids,
                    topk_weights=topk_weights,
                    expert_alignment=self.expert_alignment,
                    config=config,
                    previous_event=comm.previous_event if dbo else layout_event,
                    async_finish=async_finish,
                    allocate_on_comm_stream=False,
                ))
            self._handles.put(handle)
            if dbo:
                self._watch("dispatch", seq, a1.device)  # on the comm stream, after the kernels
        wait_event = event if async_finish else None

        def receiver() -> PrepareResult:
            if wait_event is not None:
                wait_event.current_stream_wait()
            if not dbo:
                self._watch("dispatch", seq, a1.device)
            q, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            hand_to_current_stream((q, scale, recv_topk_ids, recv_topk_weights))
            if scale is not None and self.dequantize_received:
                q, scale = dequantize_fp8_blocks(q, scale), None
            if scale is not None:
                scale = scale[:, : -(-self.hidden // FP8_BLOCK)]
            a1q = q[:, : self.hidden]
            meta = expert_tokens_meta_from_list(list(counts), a1q.device)
            return PrepareResult(a1q, scale, meta, recv_topk_ids, recv_topk_weights)

        return receiver

    # ---- finalize --------------------------------------------------------------------------

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce: TopKWeightAndReduce) -> FinalizeAsyncResult:
        handle = self._handles.take("finalize")
        x = self._reduced_input(output, fused_expert_output, topk_weights, topk_ids,
                                apply_router_weight_on_input, weight_and_reduce)
        buffer = self.buffer
        config = buffer.get_combine_config(self.num_ranks)
        # inside a run, back to compute without waiting: what the caller queues before the
        # receiver (the shared experts) runs alongside the combine; the receiver waits
        with self.comm_section(capture=buffer.capture, back="deferred") as comm:
            async_finish = self.async_finish and not comm.in_run
            seq = self._arrive("combine")
            combined, _, event = buffer.combine(x, handle, topk_weights=None, config=config,
                                                previous_event=comm.previous_event,
                                                async_finish=async_finish, allocate_on_comm_stream=False)
            if comm.in_run:
                # copy on the comm stream, so the comm-allocated result dies on its own stream
                output.copy_(combined[:, : self.hidden])
                self._watch("combine", seq, output.device)
        if comm.in_run:
            return comm.wait
        wait_event = event if async_finish else None

        def receiver() -> None:
            if wait_event is not None:
                wait_event.current_stream_wait()
            output.copy_(combined[:, : self.hidden])
            self._watch("combine", seq, output.device)

        return receiver


def make_prepare_finalize(
    group: Any,
    *,
    hidden: int,
    max_tokens_per_rank: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    use_fp8_dispatch: bool = False,
    dequantize_received: bool = True,
    async_finish: bool = True,
    expert_alignment: int = 1,
    timeout_s: float = 60.0,
    cache: DeepEPBufferCache | None = None,
) -> DeepEPHTPrepareAndFinalize:
    """Build a :class:`DeepEPHTPrepareAndFinalize` on ``group``'s shared normal-mode buffer.

    Collective on first use (creates the buffer). ``dtype`` must be bf16 (DeepEP's combine is
    bf16 only); ``device`` is accepted for a uniform factory signature (the buffer lives on the
    current CUDA device); ``max_tokens_per_rank`` is unused by normal mode (no capacity limit).
    """
    if dtype != torch.bfloat16:
        raise TypeError(f"{_NAME}: DeepEP's normal-mode combine is bf16 only, got dtype={dtype}")
    del device, max_tokens_per_rank
    padded = round_up_hidden(hidden, torch.float8_e4m3fn if use_fp8_dispatch else torch.bfloat16)
    shared = get_deepep_buffer(group, mode=BufferMode.HIGH_THROUGHPUT, hidden=padded,
                               max_tokens_per_rank=1, num_experts=num_experts, topk=topk,
                               use_fp8_dispatch=use_fp8_dispatch, cache=cache)
    return DeepEPHTPrepareAndFinalize(shared, num_experts=num_experts, hidden=hidden,
                                      use_fp8_dispatch=use_fp8_dispatch,
                                      dequantize_received=dequantize_received,
                                      async_finish=async_finish, expert_alignment=expert_alignment,
                                      timeout_s=timeout_s)
