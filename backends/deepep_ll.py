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
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dbo.errors import DBOError
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


class LowLatencyLimitError(DBOError, RuntimeError):
    """A third low-latency result would be alive, or a launch would clobber a pending receive."""


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


@dataclass
class _Result:
    kind: str  # "dispatch" or "combine"
    ubatch: int
    run: Any  # the run it was launched in, or None outside a run
    received: bool = False

    def __str__(self) -> str:
        state = "received" if self.received else "receive pending"
        return f"ubatch {self.ubatch}'s {self.kind} ({state})"


class LowLatencyResults:
    """Bookkeeping of the low-latency results alive on one buffer (see the module docstring).

    Results left by an earlier run (one that failed, or whose step was abandoned) are dropped,
    with a warning, at the first launch of a new run; ``reset()`` drops everything.
    """

    LIMIT = 2

    def __init__(self) -> None:
        self._alive: dict[int, _Result] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._alive)

    def acquire(self, kind: str) -> int:
        run = active_run()
        self._drop_stale(run)
        pending = [r for r in self._alive.values() if not r.received]
        if pending:
            raise LowLatencyLimitError(
                f"{_NAME}: {kind} launched in ubatch {dbo_current_ubatch_id()} while the receive of "
                f"{pending[0]} has not run; DeepEP's next launch would clean that receive's buffer. "
                "Run the pending recv hook first (dbo_maybe_run_recv_hook).")
        if len(self._alive) >= self.LIMIT:
            alive = ", ".join(str(r) for r in self._alive.values())
            raise LowLatencyLimitError(
                f"{_NAME}: a {kind} in ubatch {dbo_current_ubatch_id()} would be the third low-latency "
                f"result alive (alive: {alive}). DeepEP keeps two low-latency buffers, so at most two "
                "results may be alive at once: use at most 2 ubatches with deepep_ll, and finish "
                "each combine before dispatching again.")
        token = next(self._ids)
        self._alive[token] = _Result(kind, dbo_current_ubatch_id(), _run_ref(run))
        return token

    def received(self, token: int) -> None:
        r = self._alive.get(token)
        if r is not None:
            r.received = True

    def release(self, token: int) -> None:
        self._alive.pop(token, None)

    def reset(self) -> None:
        self._alive.clear()

    def _drop_stale(self, run: Any) -> None:
        stale = [t for t, r in self._alive.items() if not _same_run(r.run, run)]
        for t in stale:
            logger.warning("%s: dropping %s left by an earlier step", _NAME, self._alive.pop(t))


def _same_run(ref: Any, run: Any) -> bool:
    """True if ``ref`` (the run a result was launched in, None outside a run) is ``run``.

    The run object itself is kept (runs are not weak-referenceable), so its identity cannot be
    reused while a result refers to it."""
    return ref is run


def _run_ref(run: Any) -> Any:
    return run


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

    # ---- properties of the contract --------------------------------------------------------

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED_EXPERTS

    def reset(self) -> None:
        super().reset()
        self.results.reset()

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
        if left is not None and _same_run(left[2], active_run()):
            raise MoEProtocolError(f"{_NAME}: prepare called twice in ubatch {dbo_current_ubatch_id()} "
                               "without finalize (call reset() after a failed step)")
        token, use_hook, (recv_x, counts, handle, event, _), recv_hook, watch = self._launch(
            "dispatch", lambda use_hook: self.buffer.low_latency_dispatch(
                x, topk_ids, self.max_tokens_per_rank, self.num_experts,
                use_fp8=self.use_fp8_dispatch, async_finish=not use_hook,
                return_recv_hook=use_hook), a1.device)
        self._handles.put((handle, token, _run_ref(active_run())))
        results = self.results

        def receiver() -> PrepareResult:
            if not use_hook:
                event.current_stream_wait()
                results.received(token)
                watch()
            q, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            hand_to_current_stream((q, scale, counts))
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
        # the dispatch result is consumed once its combine is launched
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
