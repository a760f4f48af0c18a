"""The merged expert schedule: one experts call over every ubatch's received rows.

Under DBO each ubatch runs every local expert on its own rows, so the expert weights are read
once per ubatch; where the weights dominate (few rows per expert) that read is most of the
experts' time. With the ``merged`` schedule (:mod:`dbo.expert_schedule`) the
:class:`dbo.moe.MoEKernel` of a layer meets its ubatches at an :class:`ExpertsRendezvous`
after their dispatch: each ubatch, once its receive is done, deposits what it received and
yields until every ubatch of the run (``dbo_num_ubatches()``) has; the last to arrive runs the
experts once on the concatenation (:func:`merge_inputs`) and stores each ubatch's rows of the
output; the others take theirs when resumed and each combines its own.

Formats:

* STANDARD: the received tokens, their local top-k ids and weights and any per-token scales
  are concatenated along the token dim; the per-expert counts (device and, when every ubatch
  has them, host) are summed. Each ubatch's output is a row slice (a view) of the merged one.
* BATCHED_EXPERTS, for experts that take segments
  (:meth:`dbo.moe.MoEExperts.accepts_batched_segments`: :class:`dbo.experts.SwiGLUExperts` on its
  fused Triton kernels): each ubatch's ``[L, cap_u, hidden]`` slab holds expert ``e``'s rows at
  its front (``n_u[e]`` of them, counted on the device only). The merged input is one flat
  buffer ``[sum_u L * cap_u, hidden]`` whose region ``u`` (from row ``base_u = L * sum(cap_v,
  v < u)``) holds ubatch ``u``'s slab rows at the same places; only the rows that arrived are
  copied there, once (:func:`dbo.kernels.row_copies.copy_arrived_rows`, one launch per ubatch,
  no host sync; the per-row scales the same way), and ``expert_tokens_meta.segments``
  (:class:`dbo.moe.base.BatchedSegments`) carries the ``[L, U]`` counts and the caps. The
  experts write each row's output to its place in a flat output, so ubatch ``u``'s output is
  its region viewed as ``[L, cap_u, hidden]``: nothing is copied back.
* BATCHED_EXPERTS for any other experts (or more than
  :data:`dbo.moe.base.MAX_SEGMENTS` ubatches): the merged slab ``[L, sum cap_u,
  hidden]`` holds ubatch 0's rows of expert ``e``, then ubatch 1's, and so on, packed at the
  front with ``sum_u n_u[e]`` as the count; the rows that arrived are moved there
  (:func:`dbo.kernels.row_copies.move_rows`, one launch per ubatch) and each ubatch's rows of
  the output are moved back into a ``[L, cap_u, hidden]`` slab of its own (rows past its count
  unspecified, as the format allows).

Failure: a ubatch that raises anywhere makes the driver unwind the others, which throws
``GreenletExit`` into a waiting ubatch; its rendezvous is dropped on the way out, so the next
call starts clean. A waiting ubatch whose missing peers have finished without reaching the
rendezvous (or that keeps being resumed without any peer arriving) raises
:class:`MergedScheduleError` instead of spinning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dbo.kernels.row_copies import copy_arrived_rows, move_rows
from dbo.moe.base import MAX_SEGMENTS, ActivationFormat, BatchedSegments, ExpertTokensMetadata
from dbo.moe.errors import MergedScheduleError
from dbo.ubatch.context import (
    active_run,
    dbo_current_ubatch_id,
    dbo_num_live_ubatches,
    dbo_num_ubatches,
    dbo_region,
    dbo_yield,
)

__all__ = ["ExpertsInput", "ExpertsRendezvous", "merge_inputs", "run_merged", "same_call_key",
           "MAX_IDLE_YIELDS"]

#: a waiting ubatch raises after this many resumptions with no new ubatch arriving: the peers
#: are stuck elsewhere (a rendezvous of another layer), and yielding on would never end
MAX_IDLE_YIELDS = 100_000


@dataclass
class ExpertsInput:
    """What one ubatch hands its experts (the kernel's view of a ``PrepareResult``).

    STANDARD: ``a1q`` ``[M, hidden]``, ``topk_ids``/``topk_weights`` ``[M, topk]`` (local ids,
    float32 weights). BATCHED_EXPERTS: ``a1q`` ``[L, cap, hidden]`` with per-expert counts in
    ``expert_tokens_meta``; ids and weights are passed through. ``a1q_scale``: per-row scales
    laid out like ``a1q`` without its last dim, or None.
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    expert_tokens_meta: ExpertTokensMetadata | None
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None


Splitter = Callable[[torch.Tensor], list[torch.Tensor]]


# ---- merging and splitting (pure tensor code) ---------------------------------------------


def _cat(parts: Sequence[torch.Tensor | None], dim: int, what: str) -> torch.Tensor | None:
    present = [p is not None for p in parts]
    if not any(present):
        return None
    if not all(present):
        raise MergedScheduleError(f"merged experts: some ubatches received {what} and others not")
    return torch.cat(list(parts), dim=dim)


def _merge_meta(metas: Sequence[ExpertTokensMetadata | None],
                caps: Sequence[int] | None = None) -> ExpertTokensMetadata | None:
    # the summed counts; with caps, the [L, U] counts of the segments too
    if any(m is None for m in metas):
        return None  # the experts count on the device from the ids
    dtype = metas[0].expert_num_tokens.dtype
    parts = [m.expert_num_tokens for m in metas]
    if len({p.dtype for p in parts}) > 1:
        parts = [p.to(torch.int64) for p in parts]
    counts = torch.stack(parts, dim=1)  # [L, U]
    host = None
    if all(m.expert_num_tokens_cpu is not None for m in metas):
        host = torch.stack([m.expert_num_tokens_cpu.to(torch.int64) for m in metas]).sum(0)
        host = host.to(metas[0].expert_num_tokens_cpu.dtype)
    segments = None if caps is None else BatchedSegments(counts, tuple(caps))
    return ExpertTokensMetadata(counts.sum(1, dtype=dtype), host, segments)


def _merge_standard(inputs: Sequence[ExpertsInput]) -> tuple[ExpertsInput, Splitter]:
    rows = [int(i.a1q.shape[0]) for i in inputs]
    ids = [i.topk_ids for i in inputs]
    if ids[0] is not None and len({t.dtype for t in ids if t is not None}) > 1:
        ids = [t.to(torch.int64) for t in ids]
    merged = ExpertsInput(
        torch.cat([i.a1q for i in inputs]),
        _cat([i.a1q_scale for i in inputs], 0, "scales"),
        _merge_meta([i.expert_tokens_meta for i in inputs]),
        _cat(ids, 0, "top-k ids"),
        _cat([i.topk_weights for i in inputs], 0, "top-k weights"),
    )

    def split(out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(rows, dim=0))

    return merged, split


def _batched_metas(inputs: Sequence[ExpertsInput]) -> list[ExpertTokensMetadata]:
    metas = [i.expert_tokens_meta for i in inputs]
    if any(m is None for m in metas):
        raise MergedScheduleError("merged experts: BATCHED_EXPERTS activations need "
                                  "expert_tokens_meta in every ubatch")
    scales = [i.a1q_scale for i in inputs]
    if any(t is not None for t in scales) and not all(t is not None for t in scales):
        raise MergedScheduleError("merged experts: some ubatches received scales and others not")
    return metas


def _slabs_input(inputs: Sequence[ExpertsInput], move: Callable[[list[torch.Tensor]], torch.Tensor],
                 meta: ExpertTokensMetadata) -> ExpertsInput:
    """The merged BATCHED_EXPERTS input: the slabs (and any scales) moved by ``move``, the
    ubatches' top-k ids and weights concatenated."""
    scales = [i.a1q_scale for i in inputs]
    return ExpertsInput(
        move([i.a1q for i in inputs]),
        None if scales[0] is None else move(scales),
        meta,
        _cat([i.topk_ids for i in inputs], 0, "top-k ids"),
        _cat([i.topk_weights for i in inputs], 0, "top-k weights"),
    )


def _merge_segments(inputs: Sequence[ExpertsInput]) -> tuple[ExpertsInput, Splitter]:
    metas = _batched_metas(inputs)
    caps = [int(i.a1q.shape[1]) for i in inputs]
    n_local = int(inputs[0].a1q.shape[0])
    meta = _merge_meta(metas, caps)
    bases = meta.segments.bases

    def gather(parts: list[torch.Tensor]) -> torch.Tensor:
        # region u of the flat buffer is ubatch u's slab, its arrived rows copied
        flat = parts[0].new_empty(bases[-1], *parts[0].shape[2:])
        for u, (part, m) in enumerate(zip(parts, metas, strict=True)):
            region = flat[bases[u]:bases[u + 1]].view(n_local, caps[u], *part.shape[2:])
            copy_arrived_rows(part, region, m.expert_num_tokens)
        return flat

    merged = _slabs_input(inputs, gather, meta)

    def split(out: torch.Tensor) -> list[torch.Tensor]:
        return [out[bases[u]:bases[u + 1]].view(n_local, cap, *out.shape[1:])
                for u, cap in enumerate(caps)]

    return merged, split


def _merge_batched(inputs: Sequence[ExpertsInput]) -> tuple[ExpertsInput, Splitter]:
    metas = _batched_metas(inputs)
    caps = [int(i.a1q.shape[1]) for i in inputs]
    n_local, device = int(inputs[0].a1q.shape[0]), inputs[0].a1q.device
    total = sum(caps)
    meta = _merge_meta(metas, caps)
    counts = meta.segments.counts.to(torch.int64)  # [L, U]
    meta = replace(meta, segments=None)  # the experts see one packed slab
    starts = counts.cumsum(1) - counts
    expert = torch.arange(n_local, dtype=torch.int64, device=device).view(-1, 1)

    def rows(u: int) -> tuple[torch.Tensor, torch.Tensor]:
        # ubatch u's slab rows and their merged rows; -1 past the expert's count (not copied)
        j = torch.arange(caps[u], dtype=torch.int64, device=device).view(1, -1)
        merged_row = torch.where(j < counts[:, u:u + 1], expert * total + starts[:, u:u + 1] + j, -1)
        return (expert * caps[u] + j).view(-1), merged_row.view(-1)

    places = [rows(u) for u in range(len(caps))]

    def pack(parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].new_empty(n_local, total, *parts[0].shape[2:])
        for part, (slab_rows, merged_rows) in zip(parts, places, strict=True):
            move_rows(part, out, slab_rows, merged_rows, row_dims=2)
        return out

    merged = _slabs_input(inputs, pack, meta)

    def split(out: torch.Tensor) -> list[torch.Tensor]:
        parts = []
        for cap, (slab_rows, merged_rows) in zip(caps, places, strict=True):
            part = out.new_empty(n_local, cap, *out.shape[2:])
            parts.append(move_rows(out, part, merged_rows, slab_rows, row_dims=2))
        return parts

    return merged, split


def merge_inputs(fmt: ActivationFormat, inputs: Sequence[ExpertsInput], *,
                 segmented: bool = False) -> tuple[ExpertsInput, Splitter]:
    """One :class:`ExpertsInput` for the rows of all ``inputs`` (in order), and the function
    that cuts the experts' output on it back into one output per input (see the module
    docstring for the layouts). ``segmented``: BATCHED_EXPERTS for experts that take segments
    (:meth:`dbo.moe.MoEExperts.accepts_batched_segments`): the slabs laid end to end in one flat
    buffer, with ``expert_tokens_meta.segments`` (up to
    :data:`dbo.moe.base.MAX_SEGMENTS` inputs; more are packed as for other experts).
    No host sync.

    Raises:
        MergedScheduleError: the inputs cannot be merged (scales or counts in some only).
    """
    if fmt is ActivationFormat.BATCHED_EXPERTS:
        if segmented and len(inputs) <= MAX_SEGMENTS:
            return _merge_segments(inputs)
        return _merge_batched(inputs)
    return _merge_standard(inputs)


def run_merged(fmt: ActivationFormat, inputs: Sequence[ExpertsInput],
               compute: Callable[[ExpertsInput], torch.Tensor], *,
               segmented: bool = False) -> list[torch.Tensor]:
    """Each input's experts output, from one ``compute`` call on their merge
    (:func:`merge_inputs` with ``segmented``, the call, the split): what the last ubatch to
    reach an :class:`ExpertsRendezvous` runs."""
    merged, split = merge_inputs(fmt, inputs, segmented=segmented)
    return split(compute(merged))


# ---- the rendezvous -----------------------------------------------------------------------


@dataclass
class _Gather:
    """One call of the kernel by every ubatch of a run."""

    run_id: int
    num_ubatches: int
    key: tuple
    deposits: dict[int, ExpertsInput]
    results: dict[int, torch.Tensor] | None = None
    broken: bool = False


class ExpertsRendezvous:
    """Where a kernel's ubatches meet to run their experts once (one per :class:`MoEKernel`).

    The k-th call of each ubatch in a run joins the k-th gather, so a kernel called twice per
    forward (shared layers) keeps its calls apart.
    """

    def __init__(self) -> None:
        self._gathers: list[_Gather] = []

    def __len__(self) -> int:
        """Gathers in progress (0 between forwards)."""
        return len(self._gathers)

    def reset(self) -> None:
        for g in self._gathers:
            g.broken = True
        self._gathers.clear()

    def _discard(self, g: _Gather) -> None:
        g.broken = True
        if g in self._gathers:
            self._gathers.remove(g)

    def _join(self, run_id: int, ub: int, n: int, key: tuple) -> _Gather:
        for g in [g for g in self._gathers if g.run_id != run_id or g.num_ubatches != n]:
            self._discard(g)  # left by an earlier run (its waiters were unwound)
        for g in self._gathers:
            if ub not in g.deposits and g.results is None:
                if g.key != key:
                    raise MergedScheduleError(
                        f"merged experts: ubatch {ub} called the kernel with other weights or "
                        f"arguments than ubatches {sorted(g.deposits)} (the ubatches of a run must "
                        "run the same layers in the same order)")
                return g
        g = _Gather(run_id, n, key, {})
        self._gathers.append(g)
        return g

    def _wait(self, g: _Gather, ub: int) -> None:
        idle, arrived = 0, len(g.deposits)
        while g.results is None:
            if g.broken:
                raise MergedScheduleError(f"merged experts: ubatch {ub}'s rendezvous was dropped "
                                          "(reset() or a failed peer)")
            if len(g.deposits) >= dbo_num_live_ubatches():
                missing = sorted(set(range(g.num_ubatches)) - set(g.deposits))
                raise MergedScheduleError(
                    f"merged experts: ubatch {ub} waits for ubatches {missing}, which finished "
                    "without reaching this layer's experts (every ubatch must run every MoE layer)")
            dbo_yield()
            if len(g.deposits) != arrived:
                idle, arrived = 0, len(g.deposits)
            else:
                idle += 1
                if idle > MAX_IDLE_YIELDS and g.results is None:
                    raise MergedScheduleError(
                        f"merged experts: ubatch {ub} was resumed {idle} times and no other ubatch "
                        f"reached this layer's experts (have {sorted(g.deposits)}); are the others "
                        "waiting at another layer?")

    def run(self, inp: ExpertsInput, fmt: ActivationFormat, key: tuple,
            compute: Callable[[ExpertsInput], torch.Tensor], *, segmented: bool = False) -> torch.Tensor:
        """This ubatch's experts output, computed in one ``compute`` call over every ubatch's
        ``inp`` (by the last ubatch to arrive, :func:`run_merged`; its ``segmented`` decides,
        see :func:`merge_inputs`). ``key`` identifies the call's weights and arguments; every
        ubatch must bring the same one. Outside a run (or a run of one ubatch) it is
        ``compute(inp)``.

        Raises:
            MergedScheduleError: a peer can never arrive, or ``key`` differs from the peers'.
        """
        n = dbo_num_ubatches()
        run = active_run()
        if run is None or n < 2:
            return compute(inp)
        ub = dbo_current_ubatch_id()
        g = self._join(id(run), ub, n, key)
        g.deposits[ub] = inp
        try:
            if len(g.deposits) == n:
                with dbo_region("experts_merged"):
                    outs = run_merged(fmt, [g.deposits[u] for u in range(n)], compute,
                                      segmented=segmented)
                    g.results = dict(enumerate(outs))
                    g.deposits.clear()  # the inputs are no longer needed
            else:
                with dbo_region("experts_wait"):
                    self._wait(g, ub)
        except BaseException:
            self._discard(g)  # a peer still waiting on it raises or is being unwound
            raise
        out = g.results.pop(ub)
        if not g.results:
            self._discard(g)
        return out


def same_call_key(w1: torch.Tensor, w2: torch.Tensor, router_on_input: bool) -> tuple:
    """A key that is equal for two calls with the same weights and router placement."""
    return (w1.data_ptr(), tuple(w1.shape), w1.dtype, w2.data_ptr(), tuple(w2.shape), w2.dtype,
            bool(router_on_input))
