"""Interfaces of the modular MoE layer: prepare/finalize backends and experts.

The shape follows vLLM's modular MoE kernel (``fused_moe/modular_kernel.py``): a
:class:`PrepareAndFinalize` backend dispatches tokens to the ranks that hold their experts
(``prepare``) and combines the expert outputs back (``finalize``); a :class:`MoEExperts`
computes the experts on what arrived; :class:`dbo.moe.MoEKernel` drives the two and cooperates
with the ubatch context through ``prepare_async`` / ``finalize_async``.

Conventions used by every backend and experts class of this package:

* ``num_experts`` (``global_num_experts``) experts are spread over the ``num_dispatchers()``
  ranks; unless a backend says otherwise, rank ``r`` holds the contiguous block
  ``[r * L, (r + 1) * L)`` with ``L = num_experts // world_size`` local experts.
* ``topk_ids`` entries are global expert ids in ``[0, num_experts)`` on input; ``-1`` marks a
  slot that routes to no expert (padding rows use it). After ``prepare`` (STANDARD format) they
  are LOCAL ids in ``[0, L)``, with ``-1`` for slots whose expert is on another rank.
* ``topk_weights`` are float32.
"""

from __future__ import annotations

import enum
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dbo.moe.comm_section import CommSection, comm_section
from dbo.moe.weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
)

__all__ = [
    "ActivationFormat",
    "ExpertTokensMetadata",
    "BatchedSegments",
    "segment_bases",
    "MAX_SEGMENTS",
    "PrepareResult",
    "Receiver",
    "PrepareAsyncResult",
    "FinalizeAsyncResult",
    "PrepareAndFinalize",
    "MoEExperts",
    "Workspace",
    "WorkspacePool",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNoOp",
    "TopKWeightAndReduceDelegate",
]


class ActivationFormat(enum.Enum):
    """Layout of the activations handed from ``prepare`` to the experts.

    ``STANDARD``: ``[M_recv, hidden]``, one row per received token, with ``[M_recv, topk]``
    local expert ids. ``BATCHED_EXPERTS``: ``[num_local_experts, max_tokens, hidden]``, the
    tokens of each local expert packed at the front of its slab.
    """

    STANDARD = "standard"
    BATCHED_EXPERTS = "batched_experts"


#: the most ubatches whose slabs one :class:`BatchedSegments` buffer lays end to end (the
#: experts' sort of the segments takes each capacity as a scalar argument of its kernel: a device
#: tensor of them would be a host-to-device copy per call, which a CUDA graph cannot capture);
#: the merged schedule packs more ubatches as it does for experts that take no segments
MAX_SEGMENTS = 4


def segment_bases(n_experts: int, caps: Sequence[int]) -> list[int]:
    """Each segment's first row in the flat buffer of slabs of ``caps`` rows per expert laid end
    to end: ``base_u = n_experts * sum(caps[:u])``, and the buffer's rows last (``U + 1`` ints)."""
    bases = [0]
    for cap in caps:
        bases.append(bases[-1] + n_experts * int(cap))
    return bases


@dataclass(frozen=True)
class BatchedSegments:
    """Several ubatches' BATCHED_EXPERTS slabs laid end to end in one flat buffer (the merged
    expert schedule, :mod:`dbo.moe.merged`, for experts whose
    :meth:`MoEExperts.accepts_batched_segments` says so).

    The buffer is ``[L * sum(caps), hidden]``; region ``u`` starts at row ``bases[u] = L *
    sum(caps[:u])`` and is ubatch ``u``'s ``[L, caps[u], hidden]`` slab, expert ``e``'s rows the
    first ``counts[e, u]`` of its part (the rows past them unspecified). ``counts``: ``[L, U]``
    int on the activations' device; ``caps``: the ``U`` slabs' rows per expert.
    """

    counts: torch.Tensor
    caps: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.counts.dim() != 2 or self.counts.shape[1] != len(self.caps):
            raise ValueError(f"counts must be [L, U] with U = {len(self.caps)} caps, got "
                             f"{tuple(self.counts.shape)}")
        if any(int(c) < 0 for c in self.caps):
            raise ValueError(f"caps must be >= 0, got {self.caps}")

    @property
    def bases(self) -> tuple[int, ...]:
        """Each region's first row, and the buffer's rows last (``U + 1`` ints)."""
        return tuple(segment_bases(self.counts.shape[0], self.caps))


@dataclass
class ExpertTokensMetadata:
    """How many tokens each local expert received.

    ``expert_num_tokens``: ``[num_local_experts]`` int32 on the activations' device.
    ``expert_num_tokens_cpu``: the same on the CPU, if the backend has it without a sync.
    ``segments``: BATCHED_EXPERTS only, set by the merged expert schedule for experts that take
    segments: the activations are the flat buffer of :class:`BatchedSegments`, the counts above
    the sums over its regions. None otherwise.
    """

    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: torch.Tensor | None = None
    segments: BatchedSegments | None = None


class PrepareResult(NamedTuple):
    """What ``prepare`` (or a ``prepare_async`` receiver) returns.

    STANDARD format:
        a1q: ``[M_recv, hidden]`` the tokens this rank received (quantized if asked).
        a1q_scale: quantization scales, or None.
        expert_tokens_meta: optional per-local-expert counts.
        topk_ids: ``[M_recv, topk]`` LOCAL expert ids, ``-1`` for experts not on this rank.
        topk_weights: ``[M_recv, topk]`` float32.
    BATCHED_EXPERTS format:
        a1q: ``[num_local_experts, max_tokens, hidden]``; ``expert_tokens_meta`` gives the
        valid rows per local expert; ``topk_ids`` / ``topk_weights`` may be None (the backend
        keeps what it needs to combine).
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    expert_tokens_meta: ExpertTokensMetadata | None
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None


Receiver = Callable[[], PrepareResult]
#: ``prepare_async`` returns a receiver, or ``(hook, receiver)``: the hook completes the
#: receive (it may block) and must run before the receiver; the kernel hands it to the ubatch
#: context so that it runs while another ubatch's work is queued.
PrepareAsyncResult = Receiver | tuple[Callable[[], None], Receiver]
FinalizeAsyncResult = Callable[[], None] | tuple[Callable[[], None], Callable[[], None]]


class PrepareAndFinalize(ABC):
    """An all-to-all backend: dispatch tokens to experts, combine expert outputs back.

    Subclasses implement either the async pair (``prepare_async``/``finalize_async``; the sync
    ones then run hook and receiver in place) or override ``prepare``/``finalize`` and return
    False from ``supports_async``. Anything that lives between ``prepare`` and ``finalize`` or
    across a yield is kept per ubatch, indexed by ``dbo.dbo_current_ubatch_id()``.
    """

    @property
    @abstractmethod
    def activation_format(self) -> ActivationFormat:
        """The format ``prepare`` produces."""

    def topk_indices_dtype(self) -> torch.dtype | None:
        """The dtype ``topk_ids`` should have, or None if any integer dtype will do."""
        return None

    def max_num_tokens_per_rank(self) -> int | None:
        """Upper bound on tokens per rank per call, or None if unbounded."""
        return None

    @abstractmethod
    def num_dispatchers(self) -> int:
        """Number of ranks that dispatch to this rank (the EP world size)."""

    @abstractmethod
    def output_is_reduced(self) -> bool:
        """True if ``finalize``'s output is already summed over every rank's experts (no
        further all-reduce is needed)."""

    def comm_section(self, *, capture: Callable[[], Any] | None = None, yield_first: bool = True,
                     back: str = "sync", enabled: bool = True) -> AbstractContextManager[CommSection]:
        """The stream hand-over around this backend's communication under DBO, as one block:
        :func:`dbo.moe.comm_section.comm_section`."""
        return comm_section(capture=capture, yield_first=yield_first, back=back, enabled=enabled)

    def supports_async(self) -> bool:
        """True if ``prepare_async``/``finalize_async`` are implemented."""
        cls = type(self)
        return (cls.prepare_async is not PrepareAndFinalize.prepare_async
                and cls.finalize_async is not PrepareAndFinalize.finalize_async)

    # ---- prepare -----------------------------------------------------------------------

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: Any = None,
    ) -> PrepareResult:
        """Dispatch ``a1`` ``[M, hidden]`` (bf16/fp32) routed by ``topk_ids`` ``[M, topk]``
        (global ids, ``-1`` = none) with ``topk_weights`` ``[M, topk]`` float32.

        ``expert_map``: optional ``[num_experts]`` int32, global id -> local id on this rank or
        ``-1``. ``apply_router_weight_on_input``: multiply ``a1`` by the (top-1) weight before
        dispatch. ``quant_config``: backend-specific, None for unquantized.
        """
        res = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                 apply_router_weight_on_input, quant_config)
        if isinstance(res, tuple):
            hook, receiver = res
            hook()
            return receiver()
        return res()

    def prepare_async(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: Any = None,
    ) -> PrepareAsyncResult:
        """Start the dispatch; return a receiver, or ``(hook, receiver)``. Same arguments as
        :meth:`prepare`; the receiver returns its :class:`PrepareResult`."""
        raise NotImplementedError(f"{type(self).__name__} has no async prepare")

    # ---- finalize ----------------------------------------------------------------------

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce: TopKWeightAndReduce,
    ) -> None:
        """Combine ``fused_expert_output`` into ``output`` ``[M, hidden]`` in place.

        ``topk_weights``/``topk_ids`` are those ``prepare`` returned (the received ones), or
        the original ones if it returned None. ``weight_and_reduce`` is the experts' choice;
        a :class:`TopKWeightAndReduceDelegate` is replaced by the backend's own.
        """
        res = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                  apply_router_weight_on_input, weight_and_reduce)
        if isinstance(res, tuple):
            hook, receiver = res
            hook()
            receiver()
        else:
            res()

    def finalize_async(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce: TopKWeightAndReduce,
    ) -> FinalizeAsyncResult:
        """Start the combine; return a receiver, or ``(hook, receiver)``. ``output`` is valid
        only after the receiver returned."""
        raise NotImplementedError(f"{type(self).__name__} has no async finalize")

    def dispatch_holds_stream(self) -> bool:
        """True if :meth:`prepare_async` queues its data movement on the current CUDA stream
        (copies, not a kernel that returns while the data is in flight), so that work queued
        after it waits for the transfer: the ``sbo`` schedule then launches the dispatch from a
        side stream, for the shared experts to run beside it."""
        return False

    def supports_expert_groups(self) -> bool:
        """True if :meth:`finalize_group_async` is implemented: the combine can leave in parts,
        one per group of local experts, each as the group's experts end (the ``sbo`` expert
        schedule, :mod:`dbo.expert_schedule`)."""
        return False

    def finalize_group_async(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce: TopKWeightAndReduce,
        *,
        experts: tuple[int, int],
        last: bool,
    ) -> FinalizeAsyncResult:
        """Start the combine of the local experts ``experts[0]:experts[1]`` only: ``output``
        receives their share of each token's weighted sum (the groups' outputs add up to what
        :meth:`finalize` gives). ``fused_expert_output`` is the whole layer's tensor, valid at
        least in those experts' rows. The groups of one prepare are combined in order, without
        overlapping ranges, covering every local expert; ``last`` marks the last (after it the
        prepare's state is gone). Outside a ubatch run only."""
        raise NotImplementedError(f"{type(self).__name__} combines all experts at once")

    def reset(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Drop per-ubatch state left by a failed step (called between steps)."""


class Workspace:
    """Scratch tensors of one ubatch, reused across calls while their shape still fits.

    The kernel keeps one per ubatch, so a buffer that a ubatch's in-flight combine still reads
    is never handed to another ubatch.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._bound: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` on ``device`` named ``name``."""
        bound = self._bound.get(name)
        if (bound is not None and tuple(bound.shape) == tuple(shape) and bound.dtype == dtype
                and bound.device == torch.device(device)):
            return bound
        numel = 1
        for s in shape:
            numel *= s
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.device != device or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Make :meth:`get` of ``name`` return ``tensor`` (a caller's buffer, e.g. a view into a
        larger one) whenever the shape, dtype and device asked for are its own."""
        self._bound[name] = tensor

    def clear(self) -> None:
        self._bufs.clear()
        self._bound.clear()


class WorkspacePool:
    """The scratch buffers of one or more :class:`~dbo.moe.MoEKernel` s: one :class:`Workspace`
    per ubatch, and one for the merged expert schedule's call.

    A kernel has a pool of its own unless it is given one. Kernels that run one after another in
    data, each one's input computed from the previous one's output (the MoE layers of one model),
    may share a pool: a layer's experts then reuse the buffer the previous layer's combine read,
    which that combine has finished with, since this layer's tokens came out of it. The scratch
    memory is then one layer's, not one per layer (at prefill sizes, a layer's expert output is
    about a GiB). Kernels whose calls are independent in data (two branches of one layer) must
    not share one.
    """

    #: the pools :meth:`of_device` hands out, one per device, each alive while a kernel holds it
    _per_device: weakref.WeakValueDictionary[str, WorkspacePool] = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        self._ubatches: list[Workspace] = []
        self.merged = Workspace()

    @classmethod
    def of_device(cls, device: torch.device | str) -> WorkspacePool:
        """The process's pool for the MoE layers of the models it runs on ``device`` (one after
        another, as a model's layers run): what the transformers integration gives every layer.
        The pool lives while a kernel holds it: deleting the models frees its buffers."""
        key = str(torch.device(device))
        pool = cls._per_device.get(key)
        if pool is None:
            pool = cls._per_device[key] = cls()
        return pool

    def ubatch(self, ub: int) -> Workspace:
        """Ubatch ``ub``'s workspace (made at its first use)."""
        while len(self._ubatches) <= ub:
            self._ubatches.append(Workspace())
        return self._ubatches[ub]

    def clear(self) -> None:
        """Free every buffer."""
        self._ubatches.clear()
        self.merged.clear()


class MoEExperts(ABC):
    """The expert computation on what ``prepare`` delivered (vLLM's "permute-experts-unpermute").

    Weights: ``w1`` ``[num_local_experts, 2 * intermediate, hidden]`` (gate rows first, then up),
    ``w2`` ``[num_local_experts, hidden, intermediate]``.
    """

    @abstractmethod
    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        """The formats :meth:`apply` accepts."""

    @abstractmethod
    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor | None,
        topk_ids: torch.Tensor | None,
        *,
        activation_format: ActivationFormat,
        expert_tokens_meta: ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
        workspace: Workspace,
    ) -> torch.Tensor:
        """Run the local experts.

        STANDARD: ``hidden_states`` ``[M, hidden]``, ``topk_ids`` ``[M, topk]`` local ids
        (``-1`` skipped), ``topk_weights`` ``[M, topk]`` float32; returns what
        :meth:`finalize_weight_and_reduce_impl` expects (``[M, hidden]`` for NoOp,
        ``[M, topk, hidden]`` for Contiguous). BATCHED_EXPERTS: ``hidden_states``
        ``[L, max_tokens, hidden]`` with ``expert_tokens_meta``; returns ``[L, max_tokens,
        hidden]`` unweighted (rows past each expert's count are unspecified).
        The result may live in ``workspace``. When the backend delivered quantized
        activations, :class:`MoEKernel` also passes their scales as ``a1q_scale=``; experts
        that accept quantized inputs take that keyword (:class:`SwiGLUExperts` does).
        """

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        """How ``finalize`` must weight and reduce :meth:`apply`'s output."""

    def accepts_batched_segments(self, hidden_states: torch.Tensor) -> bool:
        """Whether :meth:`apply` takes the merged expert schedule's BATCHED_EXPERTS input as
        segments, for ubatch slabs like ``hidden_states`` (``[L, cap, hidden]``, its device and
        dtype): ``hidden_states`` the flat ``[L * sum(caps), hidden]`` buffer of
        :class:`BatchedSegments` (``expert_tokens_meta.segments``), the output the same shape
        with each row's output at the row's place. Default False: the schedule packs the rows
        into one ``[L, sum(caps), hidden]`` slab for :meth:`apply` and moves them back."""
        return False

    def note_global_num_experts(self, num_experts: int) -> None:  # noqa: B027 (optional hook)
        """Told by :class:`MoEKernel` before each :meth:`apply`: the experts over all ranks.
        Experts that pick kernels by size use it to estimate, without reading the device, how
        many of the (token, slot) pairs are local (about ``local / global``). Default: ignored."""
