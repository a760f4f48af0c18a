"""Pieces the DeepEP backends share: their base class, argument checks, hidden padding, fp8 block
quantization, per-ubatch state, and handing received tensors to the compute stream.

No ``deep_ep`` import here: the buffer objects come from :mod:`dbo.backends.deepep.buffer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from dbo.moe.base import ExpertTokensMetadata, PrepareAndFinalize
from dbo.moe.handles import PerUBatch
from dbo.moe.weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)
from dbo.peers.watchdog import (
    GIL_FREE_GRACE_S,
    WATCHDOG,
    WaitSite,
    call_in_named_frame,
    check_timeout,
    gil_free_deadline,
    raise_peer_timeout,
    resolve_timeout,
)
from dbo.ubatch.context import dbo_current_ubatch_id, dbo_enabled
from dbo.ubatch.streams import cuda_current_stream, hand_over

from .buffer import BufferMode, DeepEPDtypeError, SharedDeepEPBuffer

__all__ = [
    "DeepEPPrepareAndFinalize",
    "check_dispatch_args",
    "pad_hidden",
    "hand_to_current_stream",
    "expert_tokens_meta_from_list",
    "group_size",
    "group_rank",
    "check_bf16",
]


def group_size(group: Any) -> int:
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def group_rank(group: Any) -> int:
    return group.rank() if hasattr(group, "rank") else torch.distributed.get_rank(group)


class DeepEPPrepareAndFinalize(PrepareAndFinalize):
    """What every DeepEP backend is: a user of one shared buffer of a given mode, with the
    experts split evenly over its group, int64 top-k ids and an output summed over ranks."""

    #: tokens per rank per call the buffer was sized for; None where the mode has no bound
    max_tokens_per_rank: int | None = None

    #: ``hidden`` rounded up to what the mode's kernels move (set by the subclass)
    padded_hidden: int

    #: check the peers' arrival before each launch and watch the launched kernels (set False
    #: on an instance only to measure what the checks cost)
    peer_checks: bool = True

    def __init__(self, shared: SharedDeepEPBuffer, mode: BufferMode, name: str, *,
                 num_experts: int, hidden: int, use_fp8_dispatch: bool, dequantize_received: bool,
                 timeout_s: float = 60.0):
        if shared.request.mode is not mode:
            raise ValueError(f"{name} needs a {_MODE_NAMES[mode]} buffer, got mode {shared.request.mode}")
        self._name = name
        self._shared = shared
        self.num_ranks = group_size(shared.group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size "
                             f"({self.num_ranks})")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.num_ranks
        self.hidden = hidden
        self.use_fp8_dispatch = use_fp8_dispatch
        self.dequantize_received = dequantize_received
        self.timeout_s = check_timeout(timeout_s)
        if self.timeout_s is None:
            raise ValueError(f"{name}: timeout_s must be a positive number of seconds")
        self.rank = group_rank(shared.group)
        # what lives from prepare to finalize, per ubatch
        self._handles = PerUBatch(name)

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.num_ranks

    def output_is_reduced(self) -> bool:
        return True

    @property
    def buffer(self) -> Any:
        """The ``deep_ep`` buffer in use (may change if the shared buffer is grown)."""
        return self._shared.buffer

    def reset(self) -> None:
        self._handles.clear()

    # ---- peers: arrival before a launch, the GPU watchdog after it ------------------------

    def _arrive(self, phase: str) -> int:
        """Before a launch that waits for the peers: count it on the group's arrival board and
        wait (host, GIL released) until every same-host peer reached it.

        Returns the launch count (0 without a board). Raises
        :class:`dbo.errors.CollectiveTimeoutError` naming the ranks that did not arrive within
        the timeout; nothing has been launched then, so the GPU stays usable.
        """
        board = self._shared.arrival
        if board is None or not self.peer_checks:
            return 0
        seq = board.arrive()
        if board.missing(seq):
            timeout = resolve_timeout(self.timeout_s)
            missing = board.wait(seq, timeout)
            if missing:
                board.abandon()
                raise_peer_timeout(WaitSite(self._name, phase, dbo_current_ubatch_id(), self.rank),
                                   timeout, missing, board.describe(seq, missing))
        return seq

    def _watch(self, phase: str, seq: int, device: torch.device) -> None:
        """After a launch whose kernels wait for the peers: an event on the current stream for
        the GPU watchdog (CUDA only), which ends the process if it is still pending after the
        timeout (see :mod:`dbo.peers.watchdog`)."""
        if device.type != "cuda" or not self.peer_checks or torch.cuda.is_current_stream_capturing():
            return  # (a graph's replays run no Python: nothing to watch then)
        board = self._shared.arrival
        WATCHDOG.record(resolve_timeout(self.timeout_s),
                        (self._name, phase, dbo_current_ubatch_id(), self.rank),
                        None if board is None else (lambda: board.behind(seq)))

    def _host_wait(self, phase: str, fn: Callable[[], Any]) -> Any:
        """``fn()``: a DeepEP call that waits on the host holding the GIL. The process ends
        (exit code 1, the stacks on stderr, the wait named in them) if the call runs past the
        timeout plus :data:`~dbo.peers.watchdog.GIL_FREE_GRACE_S`
        (:func:`~dbo.peers.watchdog.gil_free_deadline`,
        :func:`~dbo.peers.watchdog.call_in_named_frame`); a plain call with ``peer_checks`` off."""
        if not self.peer_checks:
            return fn()
        timeout_s = resolve_timeout(self.timeout_s)
        what = (f"{self._name} {phase} of ubatch {dbo_current_ubatch_id()} on rank {self.rank}: a peer did "
                f"not arrive within {timeout_s:.1f} s (its GPU stalled, or it died); DeepEP waits for "
                "the peers' GPUs on the host, holding the GIL, so no Python thread could raise: "
                "ending the process")
        with gil_free_deadline(timeout_s + GIL_FREE_GRACE_S):
            return call_in_named_frame(what, fn)

    def _padded_input(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: torch.Tensor | None,
                      apply_router_weight_on_input: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Check ``prepare``'s arguments (and the token bound, where the mode has one); return
        ``a1`` padded to ``[M, padded_hidden]`` bf16, ``topk_weights`` float32 and ``topk_ids``
        int64."""
        a1, topk_weights, topk_ids = check_dispatch_args(
            self._name, a1, topk_weights, topk_ids, num_experts, self.num_experts, self.hidden,
            expert_map, apply_router_weight_on_input)
        if self.max_tokens_per_rank is not None and a1.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"{self._name}: {a1.shape[0]} tokens exceed max_tokens_per_rank "
                             f"{self.max_tokens_per_rank} (the capacity the buffer was sized for)")
        return pad_hidden(a1, self.padded_hidden), topk_weights, topk_ids

    def _reduced_input(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce: TopKWeightAndReduce) -> torch.Tensor:
        """Weight and reduce the experts' output over the local top-k (``Contiguous`` where the
        experts delegate it) for a combine into ``output`` ``[M, hidden]``: ``[R, padded_hidden]``
        bf16, one row per received row."""
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            weight_and_reduce = TopKWeightAndReduceContiguous()
        reduced = weight_and_reduce.apply(None, fused_expert_output, topk_weights, topk_ids,
                                          apply_router_weight_on_input)
        check_bf16(self._name, "the weighted expert output", reduced)
        if output.dim() != 2 or output.shape[1] != self.hidden:
            raise ValueError(f"{self._name}: output must be [M, {self.hidden}], got {tuple(output.shape)}")
        return pad_hidden(reduced, self.padded_hidden)


_MODE_NAMES = {BufferMode.HIGH_THROUGHPUT: "high-throughput", BufferMode.LOW_LATENCY: "low-latency",
               BufferMode.V2: "v2"}


def check_dispatch_args(
    backend: str,
    a1: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expected_num_experts: int,
    hidden: int,
    expert_map: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate ``prepare`` arguments; return ``(a1, topk_weights f32, topk_ids i64)``, contiguous,
    with the router weight applied to ``a1`` if asked."""
    if a1.dim() != 2 or a1.shape[1] != hidden:
        raise ValueError(f"{backend}: a1 must be [M, {hidden}], got {tuple(a1.shape)}")
    if a1.dtype != torch.bfloat16:
        raise DeepEPDtypeError(f"{backend}: DeepEP dispatches bf16 tokens (fp8 via use_fp8_dispatch), "
                               f"got a1 of dtype {a1.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != a1.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{backend}: topk_ids and topk_weights must both be [M={a1.shape[0]}, topk], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if num_experts != expected_num_experts:
        raise ValueError(f"{backend}: built for {expected_num_experts} experts, called with {num_experts}")
    if expert_map is not None:
        raise ValueError(f"{backend}: expert_map is not supported; DeepEP places experts contiguously "
                         "(rank r holds [r * L, (r + 1) * L))")
    topk_ids = topk_ids.to(torch.int64).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if apply_router_weight_on_input:
        if topk_ids.shape[1] != 1:
            raise ValueError(f"{backend}: apply_router_weight_on_input needs topk == 1, got "
                             f"{topk_ids.shape[1]}")
        a1 = (a1.float() * topk_weights).to(a1.dtype)
    return a1, topk_weights, topk_ids


def pad_hidden(x: torch.Tensor, padded: int) -> torch.Tensor:
    """``x`` ``[..., h]`` zero-padded on the last dim to ``[..., padded]``, contiguous."""
    h = x.shape[-1]
    if h == padded:
        return x.contiguous()
    return F.pad(x, (0, padded - h)).contiguous()


def hand_to_current_stream(tensors: Iterable[torch.Tensor | None]) -> None:
    """Under DBO on CUDA, keep tensors allocated on the comm stream alive for the compute
    stream's pending reads (``record_stream``); a no-op otherwise."""
    if not dbo_enabled():
        return
    stream = None
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        if stream is None:
            stream = cuda_current_stream(t.device)
        hand_over(t, stream)


def expert_tokens_meta_from_list(counts: list[int], device: torch.device) -> ExpertTokensMetadata:
    """Metadata from DeepEP's host-side per-local-expert counts.

    On CUDA the counts go through pinned memory with a non-blocking copy: a pageable copy
    would block the CPU until the compute stream drained, which under DBO means until the
    other ubatch's queued work has run (torch's host allocator keeps the pinned block alive
    until the copy is done).
    """
    cpu = torch.tensor(counts, dtype=torch.int32)
    if device.type == "cuda":
        cpu = cpu.pin_memory()
        return ExpertTokensMetadata(expert_num_tokens=cpu.to(device, non_blocking=True),
                                    expert_num_tokens_cpu=cpu)
    return ExpertTokensMetadata(expert_num_tokens=cpu.to(device), expert_num_tokens_cpu=cpu)


def check_bf16(backend: str, what: str, t: torch.Tensor) -> None:
    if t.dtype != torch.bfloat16:
        raise DeepEPDtypeError(f"{backend}: DeepEP's combine only takes bf16, but {what} is {t.dtype}; "
                               "run the experts in bf16 (or cast their output) before finalize")
