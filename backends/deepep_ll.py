"""DeepEP low-latency prepare/finalize: ``low_latency_dispatch`` / ``low_latency_combine`` of
``deep_ep.Buffer`` (low-latency mode), BATCHED_EXPERTS format.

Under DBO both calls use ``return_recv_hook=True``: the kernel only issues the sends (on the
current stream, no SMs held while the data is in flight) and ``prepare_async``/``finalize_async``
return ``(hook, receiver)``; the MoE kernel registers the hook with the ubatch context and
yields, so the receive runs after the other ubatch's compute has been queued. There is no stream
switch. Without DBO both calls run with ``async_finish`` on DeepEP's comm stream and the
receivers wait on its events.

DeepEP keeps two low-latency receive buffers and each launch cleans the other one, so

* a launch must never happen while another low-latency receive is still pending: every launch
  first runs the recv hook another ubatch left (``dbo_maybe_run_recv_hook``), and a pending
  receive at launch time is an error;
* at most two low-latency results may be alive at once (a dispatch result lives until its
  combine is launched, a combine result until its receiver returned): a third raises
  :class:`LowLatencyLimitError` instead of silently reusing a buffer. So deepep_ll serves at most
  two ubatches.

Under the ``sbo+dbo`` expert schedule each of two ubatches combines per expert group, so each
holds its dispatch result until its last group's combine is launched, and the two ubatches'
dispatch results and a combine would be three. There the receiver copies what the experts and
the group combines read (the received rows, the counts, the handle's tensors) out of DeepEP's
buffer and gives the dispatch result back at once: the rows that arrived only, a few percent of
a decode layer's time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dbo.expert_schedule import ExpertSchedule, current_expert_schedule
from dbo.kernels.row_copies import copy_arrived_rows
from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    FinalizeAsyncResult,
    PrepareAsyncResult,
    PrepareResult,
)
from dbo.moe.errors import MoEProtocolError
from dbo.moe.weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
)
from dbo.ubatch.context import active_run, dbo_current_ubatch_id, dbo_enabled, dbo_maybe_run_recv_hook

from .deepep.buffer import (
    LOW_LATENCY_HIDDEN_SIZES,
    BufferMode,
    DeepEPAPIError,
    DeepEPBufferCache,
    SharedDeepEPBuffer,
    get_deepep_buffer,
)
from .deepep.common import (
    DeepEPPrepareAndFinalize,
    check_bf16,
    hand_to_current_stream,
    pad_hidden,
)
from .deepep.ll_results import LowLatencyLimitError, LowLatencyResults, same_run
from .fp8 import FP8_BLOCK, dequantize_fp8_blocks

__all__ = [
    "DeepEPLLPrepareAndFinalize",
    "LowLatencyLimitError",
    "LowLatencyResults",
    "low_latency_hidden",
    "low_latency_max_tokens",
    "make_prepare_finalize",
]

logger = logging.getLogger(__name__)

_NAME = "deepep_ll"

#: DeepEP asserts ``NVSHMEM_QP_DEPTH >= (max_tokens_per_rank + 1) * 2``; 1024 is its default.
_DEFAULT_QP_DEPTH = 1024


def low_latency_hidden(hidden: int) -> int:
    """The smallest hidden size the low-latency kernels support that is >= ``hidden``."""
    for h in LOW_LATENCY_HIDDEN_SIZES:
        if h >= hidden:
            return h
    raise ValueError(f"{_NAME}: hidden {hidden} is larger than any size DeepEP's low-latency kernels "
                     f"support {LOW_LATENCY_HIDDEN_SIZES}")


def low_latency_max_tokens(max_tokens_per_rank: int, num_ranks: int) -> int:
    """``max_tokens_per_rank`` rounded up so that ``num_ranks * it`` is a multiple of 4 (TMA)."""
    m = max(int(max_tokens_per_rank), 1)
    while (m * num_ranks) % 4:
        m += 1
    return m


class DeepEPLLPrepareAndFinalize(DeepEPPrepareAndFinalize):
    """Prepare/finalize over DeepEP's low-latency mode, BATCHED_EXPERTS format.

    ``prepare`` delivers ``a1q`` ``[L, num_ranks * max_tokens_per_rank, hidden]`` (bf16; with
    fp8 dispatch and ``dequantize_received=False``: fp8 plus ``a1q_scale`` ``[L, cap, hidden //
    128]`` float32), valid only in the first ``expert_tokens_meta.expert_num_tokens[e]`` rows of
    each local expert ``e``; ``topk_ids``/``topk_weights`` are None (finalize gets the original
    ones). The experts return ``[L, cap, hidden]`` bf16 unweighted; ``finalize`` weights and
    sums in DeepEP's combine.

    Args:
        shared: the group's low-latency buffer (from :func:`get_deepep_buffer`).
        num_experts: global number of experts (a multiple of the group size).
        hidden: model hidden size (padded to the next size the kernels support).
        max_tokens_per_rank: the most tokens any rank sends in one call (equal on all ranks).
        use_fp8_dispatch: let DeepEP cast tokens to fp8 (blocks of 128) on dispatch.
        dequantize_received: with fp8, hand bf16 to the experts (default).
        timeout_s: the longest wait for the peers: before each send on the host
            (``CollectiveTimeoutError``), and for the receive kernels through the GPU watchdog
            (ends the process); see "Peer timeouts" in ``docs/backends.md``.
    """

    def __init__(self, shared: SharedDeepEPBuffer, *, num_experts: int, hidden: int,
                 max_tokens_per_rank: int, use_fp8_dispatch: bool = False,
                 dequantize_received: bool = True, timeout_s: float = 60.0):
        super().__init__(shared, BufferMode.LOW_LATENCY, _NAME, num_experts=num_experts, hidden=hidden,
                         use_fp8_dispatch=use_fp8_dispatch, dequantize_received=dequantize_received,
                         timeout_s=timeout_s)
        self.padded_hidden = low_latency_hidden(hidden)
        self.max_tokens_per_rank = low_latency_max_tokens(max_tokens_per_rank, self.num_ranks)
        qp_depth = getattr(shared.buffer, "nvshmem_qp_depth", _DEFAULT_QP_DEPTH)
        if qp_depth < (self.max_tokens_per_rank + 1) * 2:
            raise DeepEPAPIError(
                f"{_NAME}: max_tokens_per_rank {self.max_tokens_per_rank} needs NVSHMEM_QP_DEPTH >= "
                f"{(self.max_tokens_per_rank + 1) * 2} (is {qp_depth}); set the environment variable "
                "before the buffer is created, or lower max_tokens_per_rank")
        req = shared.request
        if (req.hidden < self.padded_hidden or req.max_tokens_per_rank < self.max_tokens_per_rank
                or req.num_experts != num_experts):
            raise ValueError(f"the shared low-latency buffer was sized for {req}, this backend needs "
                             f"hidden {self.padded_hidden}, {self.max_tokens_per_rank} tokens per rank "
                             f"and {num_experts} experts")
        # DeepEP's two low-latency buffers belong to the buffer, not to one layer's backend:
        # every backend on this buffer shares the bookkeeping
        self.results: LowLatencyResults = shared.extra.setdefault("low_latency_results",
                                                                  LowLatencyResults())
        #: per ubatch, [handle, dispatch token, next expert, top-k ids, each slot's local expert]
        #: between the group combines of one prepare
        self._group_state: dict[int, list] = {}
        self._group_masks: dict[tuple, torch.Tensor] = {}

    # ---- properties of the contract --------------------------------------------------------

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED_EXPERTS

    def reset(self) -> None:
        super().reset()
        self.results.reset()
        self._group_state.clear()

    def _launch_guard(self, kind: str) -> int:
        # A hook another ubatch left in our slot must complete before we launch (DeepEP's next
        # launch cleans the buffer that receive reads).
        dbo_maybe_run_recv_hook()
        token = self.results.acquire(kind)
        self._shared.prepare_low_latency(self.max_tokens_per_rank, self.padded_hidden, self.num_experts)
        return token

    def _launch(self, kind: str, launch: Callable[[bool], tuple], device: torch.device
                ) -> tuple[int, bool, tuple, Callable[[], None], Callable[[], None]]:
        """Launch a low-latency ``kind`` through ``launch(use_hook)``, which calls the buffer
        (with ``return_recv_hook=use_hook``: under DBO; the hook is its last output).

        Before the launch, the peers' arrival is checked (``kind + " send"`` under DBO).
        Returns the result's token, ``use_hook``, the buffer's outputs, the recv hook (which
        also marks the result received and hands its kernel to the GPU watchdog), and ``watch``
        for the receiver of the hook-less path. A launch that raises gives its token back.
        """
        token = self._launch_guard(kind)
        use_hook = dbo_enabled()
        try:
            seq = self._arrive(f"{kind} send" if use_hook else kind)
            out = launch(use_hook)
        except BaseException:
            self.results.release(token)
            raise
        hook, results = out[-1], self.results

        def recv_hook() -> None:
            hook()
            results.received(token)
            self._watch(f"{kind} receive", seq, device)

        def watch() -> None:
            self._watch(kind, seq, device)

        return token, use_hook, out, recv_hook, watch

    # ---- prepare ---------------------------------------------------------------------------

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: torch.Tensor | None,
                      apply_router_weight_on_input: bool, quant_config: Any = None) -> PrepareAsyncResult:
        x, topk_weights, topk_ids = self._padded_input(a1, topk_weights, topk_ids, num_experts,
                                                       expert_map, apply_router_weight_on_input)
        left = self._handles.peek()
        if left is not None and same_run(left[2], active_run()):
            raise MoEProtocolError(f"{_NAME}: prepare called twice in ubatch {dbo_current_ubatch_id()} "
                               "without finalize (call reset() after a failed step)")
        token, use_hook, (recv_x, counts, handle, event, _), recv_hook, watch = self._launch(
            "dispatch", lambda use_hook: self.buffer.low_latency_dispatch(
                x, topk_ids, self.max_tokens_per_rank, self.num_experts,
                use_fp8=self.use_fp8_dispatch, async_finish=not use_hook,
                return_recv_hook=use_hook), a1.device)
        self._handles.put((handle, token, active_run()))
        # a new dispatch: any group combines a failed step left in this ubatch go
        self._group_state.pop(dbo_current_ubatch_id(), None)
        results = self.results
        copy_out = use_hook and current_expert_schedule() is ExpertSchedule.SBO_DBO

        def receiver() -> PrepareResult:
            nonlocal counts
            if not use_hook:
                event.current_stream_wait()
                results.received(token)
                watch()
            q, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            hand_to_current_stream((q, scale, counts))
            if copy_out:  # see the module docstring
                q, scale, counts = self._copy_out_received(q, scale, counts)
                results.release(token)
            if scale is not None and self.dequantize_received:
                q, scale = dequantize_fp8_blocks(q, scale), None
            a1q = q[..., : self.hidden]
            if scale is not None:  # the blocks of the padded hidden's first ``hidden`` elements
                scale = scale[..., : -(-self.hidden // FP8_BLOCK)]
            return PrepareResult(a1q, scale, ExpertTokensMetadata(counts, None), None, None)

        return (recv_hook, receiver) if use_hook else receiver

    # ---- finalize --------------------------------------------------------------------------

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce: TopKWeightAndReduce) -> FinalizeAsyncResult:
        handle, dispatch_token, _ = self._handles.take("finalize")
        return self._combine(output, fused_expert_output, topk_weights, topk_ids,
                             apply_router_weight_on_input, weight_and_reduce, handle,
                             dispatch_token, release_dispatch=True)

    def supports_expert_groups(self) -> bool:
        return True

    def finalize_group_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             apply_router_weight_on_input: bool,
                             weight_and_reduce: TopKWeightAndReduce, *, experts: tuple[int, int],
                             last: bool) -> FinalizeAsyncResult:
        """One group's combine: DeepEP's combine with the handle's counts of the other local
        experts at zero (their rows are not sent) and the tokens' top-k ids outside the group at
        ``-1`` (not summed), so ``output`` gets the group's share. The dispatch's result stays
        alive until the last group's combine is launched (each group's combine is received
        before the next is launched: at most the two results DeepEP allows), unless the receive
        copied it out (``sbo+dbo``, see the module docstring). Per ubatch."""
        g0, g1 = experts
        n_local = self.num_local_experts
        if not 0 <= g0 < g1 <= n_local:
            raise ValueError(f"{_NAME}: experts must be a range (start, stop) within 0..{n_local}, "
                             f"got {experts}")
        ub = dbo_current_ubatch_id()
        state = self._group_state.get(ub)
        if state is None:
            if g0 != 0:
                raise MoEProtocolError(f"{_NAME}: the first group's combine must start at expert 0, "
                                       f"got {experts}")
            handle, dispatch_token, _ = self._handles.take("finalize")
            ids = topk_ids.to(torch.int64)
            # each slot's local expert, n_local where the slot has none: no group's range holds it
            slot_expert = torch.where(ids >= 0, torch.remainder(ids, n_local), n_local)
            state = self._group_state[ub] = [handle, dispatch_token, 0, ids, slot_expert]
        handle, dispatch_token, start, ids, slot_expert = state
        if g0 != start or (last and g1 != n_local):
            del self._group_state[ub]
            raise MoEProtocolError(f"{_NAME}: group combines must cover the local experts in order "
                                   f"without gaps; expected one from expert {start}"
                                   f"{' to ' + str(n_local) if last else ''}, got {experts}")
        state[2] = g1
        if last:
            del self._group_state[ub]
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        counts = torch.where(self._experts_mask(g0, g1, layout_range.device), layout_range, 0)
        keep = slot_expert < g1 if g0 == 0 else (slot_expert >= g0) & (slot_expert < g1)
        group_ids = torch.where(keep, ids, -1)
        return self._combine(output, fused_expert_output, topk_weights, group_ids,
                             apply_router_weight_on_input, weight_and_reduce,
                             (src_info, counts, max_tokens, hidden, num_experts), dispatch_token,
                             release_dispatch=last)

    def _copy_out_received(self, q: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The running ubatch's received dispatch out of DeepEP's buffer: the rows that arrived
        of ``q`` (and of ``scale``), the counts and the handle's tensors, copied into memory of
        its own (rows past each count left unset, as the layout allows)."""
        own_q = copy_arrived_rows(q, torch.empty_like(q, memory_format=torch.contiguous_format), counts)
        own_scale = None if scale is None else copy_arrived_rows(
            scale, torch.empty_like(scale, memory_format=torch.contiguous_format), counts)
        handle, token, run = self._handles.take("the dispatch's receive")
        src_info, layout_range, *rest = handle
        self._handles.put(((src_info.clone(), layout_range.clone(), *rest), token, run))
        return own_q, own_scale, counts.clone()

    def _experts_mask(self, g0: int, g1: int, device: torch.device) -> torch.Tensor:
        """``[L, 1]`` bool, True for the local experts ``g0:g1``; made once per range and device
        (the first step makes it, before any CUDA graph captures the group combines)."""
        key = (g0, g1, str(device))
        mask = self._group_masks.get(key)
        if mask is None:
            rows = torch.arange(self.num_local_experts, device=device).view(-1, 1)
            mask = self._group_masks[key] = (rows >= g0) & (rows < g1)
        return mask

    def _combine(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool, weight_and_reduce: TopKWeightAndReduce,
                 handle: tuple, dispatch_token: int, release_dispatch: bool) -> FinalizeAsyncResult:
        if not isinstance(weight_and_reduce, (TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOp)):
            raise ValueError(f"{_NAME}: DeepEP's low-latency combine weights and reduces itself; the "
                             f"experts must leave it to finalize (Delegate or NoOp), not "
                             f"{weight_and_reduce!r}")
        check_bf16(_NAME, "the expert output", fused_expert_output)
        expected = (self.num_local_experts, self.num_ranks * self.max_tokens_per_rank, self.hidden)
        if tuple(fused_expert_output.shape) != expected:
            raise ValueError(f"{_NAME}: expert output must be {list(expected)}, got "
                             f"{list(fused_expert_output.shape)}")
        x = pad_hidden(fused_expert_output, self.padded_hidden)
        topk_ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        if apply_router_weight_on_input:
            weights = torch.ones_like(weights)
        direct = (self.padded_hidden == self.hidden and output.is_contiguous()
                  and output.dtype == torch.bfloat16)
        # the dispatch result is consumed once its (last) combine is launched
        if release_dispatch:
            self.results.release(dispatch_token)
        token, use_hook, (combined, event, _), recv_hook, watch = self._launch(
            "combine", lambda use_hook: self.buffer.low_latency_combine(
                x, topk_ids, weights, handle, async_finish=not use_hook,
                return_recv_hook=use_hook, out=output if direct else None), output.device)
        results = self.results

        def receiver() -> None:
            if not use_hook:
                event.current_stream_wait()
                watch()
            if not direct:
                output.copy_(combined[:, : self.hidden])
            results.release(token)

        return (recv_hook, receiver) if use_hook else receiver


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
    timeout_s: float = 60.0,
    cache: DeepEPBufferCache | None = None,
) -> DeepEPLLPrepareAndFinalize:
    """Build a :class:`DeepEPLLPrepareAndFinalize` on ``group``'s shared low-latency buffer.

    Collective on first use. ``dtype`` must be bf16; ``device`` is accepted for a uniform
    factory signature. ``max_tokens_per_rank`` must be the same on all ranks and at most 511
    with NVSHMEM's default QP depth.
    """
    if dtype != torch.bfloat16:
        raise TypeError(f"{_NAME}: DeepEP's low-latency kernels are bf16, got dtype={dtype}")
    del device
    num_ranks = group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)
    shared = get_deepep_buffer(group, mode=BufferMode.LOW_LATENCY, hidden=low_latency_hidden(hidden),
                               max_tokens_per_rank=low_latency_max_tokens(max_tokens_per_rank, num_ranks),
                               num_experts=num_experts, topk=topk, use_fp8_dispatch=use_fp8_dispatch,
                               cache=cache)
    return DeepEPLLPrepareAndFinalize(shared, num_experts=num_experts, hidden=hidden,
                                      max_tokens_per_rank=max_tokens_per_rank,
                                      use_fp8_dispatch=use_fp8_dispatch,
                                      dequantize_received=dequantize_received,
                                      timeout_s=timeout_s)
