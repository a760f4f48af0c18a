"""SwiGLU experts for both activation formats, without a host sync on CUDA.

``y = w2 @ (silu(g) * u)`` with ``[g; u] = w1 @ x``.

STANDARD format: the (token, slot) pairs are sorted by local expert on the device
(:mod:`dbo.experts.grouping`); two grouped GEMMs (:mod:`dbo.experts.kernels.grouped_gemm`:
``torch._grouped_mm`` for bf16 on Hopper, a Triton grouped GEMM otherwise on CUDA) run on the
per-expert end rows, which come from the backend's host-side counts when it has them
(``ExpertTokensMetadata.expert_num_tokens_cpu``, DeepEP normal mode) or are computed on the
device. Host counts must be exact (DeepEP's ``expert_alignment`` left at 1): they are trusted,
since checking them would read the GPU. The activation is one fused kernel; each token's output
is a gather-reduce of its slots' rows weighted by the router
(:mod:`dbo.experts.kernels.gather_reduce`: Triton, float32 accumulation, no atomics). Nothing in
:meth:`SwiGLUExperts.apply` reads the GPU back, so under DBO the CPU queues the other ubatch's
work while these kernels run. On the CPU (and without Triton) the same steps run in plain torch.

BATCHED_EXPERTS format: on CUDA the fused kernels over the rows that arrived, with the counts
read on the device (:mod:`dbo.experts.kernels.batched`; without Triton, or with ``batched_rows``,
two batched matmuls over each expert's slab); a loop over the experts that received tokens on
the CPU. Under the merged expert schedule the fused kernels (on CUDA, or on the CPU with
``use_triton=True``: Triton's interpreter) take every ubatch's slab at once as segments of one
flat buffer (:class:`dbo.moe.base.BatchedSegments`, :meth:`SwiGLUExperts.accepts_batched_segments`)
and write each row's output to its place there, so that no row is moved back; elsewhere
segments are run one slab at a time.

Persistent grids and the SM carve-out: the fused kernels' persistent GEMMs size their grid to
the device's SMs less the carve-out in force at the call, passed down to the launch as an
argument: the run's (:func:`dbo.ubatch.sm.current_experts_sm_carveout`, set by the overlapped
forward's ``sm_carveout`` together with torch's carve-out for cuBLAS), else
``SwiGLUExperts.sm_carveout``. The run's value reaches every SwiGLUExperts its forward calls,
wherever the model keeps them.

fp8 inputs: a backend that hands over fp8 activations with DeepEP's block scales (one float32
scale per 128 hidden elements, ``a1q_scale``) gets them dequantized to the weights' dtype before
the first GEMM; the GEMMs themselves run in the weights' dtype.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F

from dbo.experts.grouping import group_by_expert
from dbo.experts.kernels.batched import batched_swiglu_experts, segmented_swiglu_experts
from dbo.experts.kernels.fused_experts import fused_swiglu_experts, prefer_fused
from dbo.experts.kernels.gather_reduce import gather_reduce, gather_rows, silu_and_mul
from dbo.experts.kernels.grouped_gemm import grouped_mm
from dbo.kernels.triton_launch import use_triton_for
from dbo.moe.base import (
    ActivationFormat,
    BatchedSegments,
    ExpertTokensMetadata,
    MoEExperts,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    Workspace,
)
from dbo.moe.validate import check_expert_weights
from dbo.ubatch.sm import check_sm_carveout, current_experts_sm_carveout

__all__ = ["SwiGLUExperts", "MAX_SCRATCH_BYTES", "swiglu_expert", "dequantize_blocks", "FP8_SCALE_BLOCK",
           "find_swiglu_experts"]

logger = logging.getLogger(__name__)

#: the default bound of one STANDARD pass's largest scratch tensor (``SwiGLUExperts(max_scratch_bytes=...)``):
#: 4 GiB is 37,449 tokens of hidden 7168 bf16 at top-8 (a rank of EP 32 receives about 117k tokens
#: in a prefill of 16384 per rank)
MAX_SCRATCH_BYTES = 4 << 30

#: hidden elements per fp8 scale (DeepEP's layout)
FP8_SCALE_BLOCK = 128
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``x`` ``[N, hidden]``, ``w1`` ``[2I, hidden]``, ``w2`` ``[hidden, I]`` ->
    ``[N, hidden]`` in ``x``'s dtype."""
    h = x @ w1.t()
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def dequantize_blocks(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., H]`` (fp8, or any dtype when ``scale`` is None) times ``scale``
    ``[..., ceil(H / 128)]`` float32, block-wise, as ``dtype``; ``x`` itself when ``scale`` is None."""
    if scale is None:
        if x.dtype in _FP8:
            raise TypeError(f"activations of dtype {x.dtype} need their scales (a1q_scale)")
        return x
    h = x.shape[-1]
    if scale.shape[:-1] != x.shape[:-1] or scale.shape[-1] != -(-h // FP8_SCALE_BLOCK):
        raise ValueError(f"a1q_scale must be [..., ceil(hidden / {FP8_SCALE_BLOCK})] = "
                         f"{(*x.shape[:-1], -(-h // FP8_SCALE_BLOCK))}, got {tuple(scale.shape)}")
    s = scale.to(torch.float32).unsqueeze(-1).expand(*scale.shape, FP8_SCALE_BLOCK).flatten(-2)[..., :h]
    return (x.to(torch.float32) * s).to(dtype)


class SwiGLUExperts(MoEExperts):
    """SwiGLU experts on local expert weights (see the module docstring).

    Args:
        reduce_in_experts: in STANDARD format, weight by ``topk_weights`` and sum over top-k
            here (output ``[M, hidden]``, finalize does nothing more); if False return
            ``[M, topk, hidden]`` unweighted and leave it to TopKWeightAndReduceContiguous.
        use_grouped_mm: allow ``torch._grouped_mm`` (default: where it applies).
        use_triton: use the Triton kernels (default: on CUDA when Triton is importable; False
            forces the plain torch versions, True forces Triton, e.g. under TRITON_INTERPRET).
        batched_rows: BATCHED_EXPERTS on CUDA: two batched matmuls over the first
            ``batched_rows`` rows of each expert's slab (rows past it are left unwritten), in
            place of the fused kernels over the rows that arrived. Only for a caller that knows
            no expert receives more; default None (the fused kernels where Triton runs, else
            the matmuls over whole slabs).
        fused: STANDARD format with Triton: the fused kernels of :mod:`dbo.experts.kernels.fused_experts`
            (gather in the first GEMM's prologue, activation in its epilogue, slot scatter in
            the second's). Default: chosen per call by the estimated rows per expert
            (:func:`dbo.experts.kernels.fused_experts.prefer_fused`: fused up to 768 rows per expert, and at
            any size for I <= 2048 or for at most 128 local experts, the unfused steps with
            CUTLASS's grouped GEMM above); True forces the fused kernels, False the unfused steps.
        num_global_experts: experts over all ranks, for that estimate without host counts
            (``M * topk * local / global`` pairs); :class:`MoEKernel` sets it on every call.
            Unknown: every slot is counted as local (an overestimate).
        sm_carveout: SMs the fused kernels' persistent grids leave free for kernels on other
            streams (the other ubatch's communication); None (default): they use every SM. A
            carve-out set for a run (the overlapped forward's ``sm_carveout``, or a
            :func:`dbo.ubatch.sm.experts_sm_carveout` block) takes its place while it is in
            force; the attribute itself is never written.
        max_scratch_bytes: STANDARD format: the most bytes a pass's largest scratch tensor (a
            row per slot, ``[tokens * topk, hidden]``) may take; a call over more tokens runs in
            chunks of tokens (:meth:`chunk_tokens`), as a large prefill's received rows would
            not fit the GPU otherwise (default :data:`MAX_SCRATCH_BYTES`; None: one pass).
    """

    def __init__(self, *, reduce_in_experts: bool = True, use_grouped_mm: bool | None = None,
                 use_triton: bool | None = None, batched_rows: int | None = None,
                 fused: bool | None = None, num_global_experts: int | None = None,
                 sm_carveout: int | None = None, max_scratch_bytes: int | None = MAX_SCRATCH_BYTES):
        if batched_rows is not None and batched_rows < 1:
            raise ValueError(f"batched_rows must be >= 1 or None, got {batched_rows}")
        if max_scratch_bytes is not None and (not isinstance(max_scratch_bytes, int)
                                              or max_scratch_bytes < 1):
            raise ValueError(f"max_scratch_bytes must be an int >= 1 or None, got {max_scratch_bytes!r}")
        self.max_scratch_bytes = max_scratch_bytes
        self.sm_carveout = check_sm_carveout(sm_carveout)
        self.reduce_in_experts = reduce_in_experts
        self.use_grouped_mm = use_grouped_mm
        self.use_triton = use_triton
        self.batched_rows = batched_rows
        self.fused = fused
        self.num_global_experts = num_global_experts
        self._bounds: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        if self.reduce_in_experts:
            return TopKWeightAndReduceNoOp()
        return TopKWeightAndReduceContiguous()

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None, *,
              activation_format: ActivationFormat, expert_tokens_meta: ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool, workspace: Workspace,
              a1q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`MoEExperts.apply`; ``a1q_scale``: block scales of fp8 ``hidden_states``
        (``[..., ceil(hidden / 128)]`` float32), dequantized here."""
        self._format = activation_format
        x = dequantize_blocks(hidden_states, a1q_scale, w1.dtype)
        if activation_format is ActivationFormat.BATCHED_EXPERTS:
            return self._apply_batched(x, w1, w2, expert_tokens_meta, workspace, topk_ids)
        return self._apply_standard(x, w1, w2, topk_weights, topk_ids, expert_tokens_meta,
                                    apply_router_weight_on_input, workspace)

    # ---- STANDARD -------------------------------------------------------------------------

    def _apply_standard(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        meta: ExpertTokensMetadata | None, router_on_input: bool,
                        workspace: Workspace) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"STANDARD activations must be [num_tokens, hidden], got {tuple(x.shape)}")
        m, hidden = x.shape
        n_local = check_expert_weights(w1, w2, hidden, x.dtype)
        topk = topk_ids.shape[1]
        shape = (m, hidden) if self.reduce_in_experts else (m, topk, hidden)
        out = workspace.get("fused_out", shape, x.dtype, x.device)
        host = None if meta is None else meta.expert_num_tokens_cpu
        if host is not None and host.numel() != n_local:
            raise ValueError(f"expert_tokens_meta has {host.numel()} host-side counts for "
                             f"{n_local} local experts")
        if host is not None:
            pairs = int(host.sum())
        else:  # the slots' share that is local, expected: nothing is read from the device
            share = 1.0 if not self.num_global_experts else min(1.0, n_local / self.num_global_experts)
            pairs = max(1, round(m * topk_ids.shape[1] * share))
        weights = torch.ones_like(topk_weights) if router_on_input else topk_weights
        chunk = self.chunk_tokens(topk, hidden, x.element_size())
        if m <= chunk:
            return self._standard_rows(x, w1, w2, weights, topk_ids, host, pairs, out, n_local)
        # in chunks of tokens, each with its share of the pairs (the host's counts are the
        # whole call's: no chunk's bound): every token's output is its own row's
        for a in range(0, m, chunk):
            b = min(m, a + chunk)
            self._standard_rows(x[a:b], w1, w2, weights[a:b], topk_ids[a:b], None,
                                max(1, round(pairs * (b - a) / m)), out[a:b], n_local)
        return out

    def chunk_tokens(self, topk: int, hidden: int, elem_bytes: int) -> int:
        """The most tokens one STANDARD pass takes: its largest scratch tensor, a row per slot
        (``[tokens * topk, hidden]``), within :attr:`max_scratch_bytes`."""
        if self.max_scratch_bytes is None:
            return sys.maxsize
        return max(1, self.max_scratch_bytes // max(1, topk * hidden * elem_bytes))

    def _standard_rows(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, topk_ids: torch.Tensor, host: torch.Tensor | None,
                       pairs: int, out: torch.Tensor, n_local: int) -> torch.Tensor:
        """The experts over ``x``'s tokens into ``out`` (``pairs``: their local pairs, the host's
        count where ``host`` is given, else an estimate)."""
        m, hidden = x.shape
        topk = topk_ids.shape[1]
        if m and self._use_fused(x, pairs / n_local, w2.shape[2], n_local):
            return fused_swiglu_experts(
                x, w1, w2, weights, topk_ids, out=out, reduce=self.reduce_in_experts,
                max_local_pairs=None if host is None else pairs, rows_per_expert=pairs / n_local,
                bounds=self._bounds_for(n_local, x.device), sm_carveout=self.carveout_in_force())
        groups = group_by_expert(topk_ids, n_local, host) if m else None
        if groups is None or groups.num_rows == 0:
            return out.zero_()
        kw = {"use_grouped_mm": self.use_grouped_mm, "use_triton": self.use_triton}
        # without host counts the rows past the local pairs are padding: the kernels skip them
        valid = groups.num_valid if groups.host_counts is None else None
        xs = gather_rows(x, groups.tokens, valid, use_triton=self.use_triton)
        h = grouped_mm(xs, w1, groups.offsets, groups.host_counts, **kw)
        act = silu_and_mul(h, valid, use_triton=self.use_triton)
        y = grouped_mm(act, w2, groups.offsets, groups.host_counts, **kw)
        if not self.reduce_in_experts:
            rows = y.index_select(0, groups.slot_rows.reshape(-1))
            zero = rows.new_zeros(())
            torch.where(groups.local.reshape(-1, 1), rows, zero, out=out.view(m * topk, hidden))
            return out
        return gather_reduce(y, groups.slot_rows, weights, groups.local, out=out,
                             use_triton=self.use_triton)

    def _use_fused(self, x: torch.Tensor, rows_per_expert: float, inter: int, n_local: int) -> bool:
        if self.fused is False or not use_triton_for(x, self.use_triton):
            return False
        # a CPU tensor reaches here only with use_triton=True (Triton's interpreter): fused
        return self.fused is True or not x.is_cuda or x.element_size() > 2 \
            or prefer_fused(rows_per_expert, inter, n_local)

    def carveout_in_force(self) -> int | None:
        """The SMs this call's persistent grids leave free: the run's carve-out where one is
        set (:func:`dbo.ubatch.sm.current_experts_sm_carveout`), else :attr:`sm_carveout`."""
        return current_experts_sm_carveout(self.sm_carveout)

    def note_global_num_experts(self, num_experts: int) -> None:
        self.num_global_experts = num_experts

    def _bounds_for(self, n_local: int, device: torch.device) -> torch.Tensor:
        # arange(1, E + 1) for the offsets' searchsorted, made once per device (one launch less)
        key = (n_local, device)
        if key not in self._bounds:
            self._bounds[key] = torch.arange(1, n_local + 1, dtype=torch.int16, device=device)
        return self._bounds[key]

    # ---- BATCHED_EXPERTS ------------------------------------------------------------------

    def accepts_batched_segments(self, hidden_states: torch.Tensor) -> bool:
        """True where the fused kernels run on slabs like ``hidden_states`` (Triton on CUDA, or
        on the CPU with ``use_triton=True``, and no ``batched_rows``): they take the merged
        schedule's slabs as segments (see :meth:`MoEExperts.accepts_batched_segments`)."""
        return self._fused_slabs(hidden_states)

    def _fused_slabs(self, x: torch.Tensor) -> bool:
        # the fused kernels over the rows that arrived (on the CPU: Triton's interpreter)
        return self.batched_rows is None and use_triton_for(x, self.use_triton)

    def _apply_batched(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       meta: ExpertTokensMetadata | None, workspace: Workspace,
                       topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        if meta is None:
            raise ValueError("BATCHED_EXPERTS format needs expert_tokens_meta")
        if meta.segments is not None:
            return self._apply_segments(x, w1, w2, meta.segments, workspace, topk_ids)
        if x.dim() != 3:
            raise ValueError(f"BATCHED_EXPERTS activations must be [num_local_experts, max_tokens, "
                             f"hidden], got shape {tuple(x.shape)}")
        n_local, max_tokens, hidden = x.shape
        check_expert_weights(w1, w2, hidden, x.dtype, n_local)
        out = workspace.get("fused_out", (n_local, max_tokens, hidden), x.dtype, x.device)
        est = None if topk_ids is None else topk_ids.numel() / n_local
        return self._slabs(x, w1, w2, meta.expert_num_tokens, meta.expert_num_tokens_cpu, out, est)

    def _apply_segments(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        seg: BatchedSegments, workspace: Workspace,
                        topk_ids: torch.Tensor | None) -> torch.Tensor:
        n_local = seg.counts.shape[0]
        bases = seg.bases
        if x.dim() != 2 or x.shape[0] != bases[-1]:
            raise ValueError(f"segmented BATCHED_EXPERTS activations must be [L * sum(caps), hidden] "
                             f"= [{bases[-1]}, hidden] for L={n_local}, caps={seg.caps}; got "
                             f"{tuple(x.shape)}")
        hidden = x.shape[1]
        check_expert_weights(w1, w2, hidden, x.dtype, n_local)
        out = workspace.get("fused_out", tuple(x.shape), x.dtype, x.device)
        est = None if topk_ids is None else topk_ids.numel() / n_local
        if self._fused_slabs(x):
            return segmented_swiglu_experts(x, w1, w2, seg.counts, seg.caps, out=out,
                                            rows_per_expert=est, sm_carveout=self.carveout_in_force())
        for u, cap in enumerate(seg.caps):  # one slab at a time, each into its region of out
            rows = slice(bases[u], bases[u + 1])
            self._slabs(x[rows].view(n_local, cap, hidden), w1, w2, seg.counts[:, u], None,
                        out[rows].view(n_local, cap, hidden), est)
        return out

    def _slabs(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
               counts_cpu: torch.Tensor | None, out: torch.Tensor, est: float | None) -> torch.Tensor:
        # the experts on x [L, cap, hidden] (expert e's rows the first counts[e]) into out
        n_local, max_tokens, _ = x.shape
        if x.is_cuda and self._fused_slabs(x):
            # the rows that arrived only (the counts stay on the device); rows past them are
            # left unwritten, which finalize ignores
            return batched_swiglu_experts(x, w1, w2, counts, out=out, rows_per_expert=est,
                                          sm_carveout=self.carveout_in_force())
        if x.is_cuda:
            # padded rows compute garbage, which finalize ignores; two launches beat a loop
            rows = max_tokens if self.batched_rows is None else min(self.batched_rows, max_tokens)
            h = torch.bmm(x[:, :rows], w1.transpose(1, 2))
            act = silu_and_mul(h.view(n_local * rows, -1), use_triton=self.use_triton)
            y = act.view(n_local, rows, -1)
            if rows == max_tokens:
                torch.bmm(y, w2.transpose(1, 2), out=out)
            else:
                out[:, :rows] = torch.bmm(y, w2.transpose(1, 2))
            return out
        if counts_cpu is None:
            counts_cpu = counts.cpu()
        for e, c in enumerate(counts_cpu.tolist()):
            if c > max_tokens:
                raise ValueError(f"expert_tokens_meta says expert {e} has {c} tokens, more than "
                                 f"max_tokens={max_tokens}")
            if c:
                out[e, :c] = swiglu_expert(x[e, :c], w1[e], w2[e])
        return out


def find_swiglu_experts(model: Any) -> list[SwiGLUExperts]:
    """The distinct :class:`SwiGLUExperts` that ``model`` runs, where dbo's MoE layers keep them.

    For inspection only: the overlapped forward's carve-out reaches the experts without it
    (:func:`dbo.ubatch.sm.current_experts_sm_carveout`).

    ``model``: an ``nn.Module`` (each of its modules is searched), a bound method of one (its
    module), or any other object (searched itself). An object's attributes are searched one
    level deep: a :class:`SwiGLUExperts`, or an object holding one as its ``experts`` attribute
    (a :class:`dbo.moe.MoEKernel`, the transformers integration's expert-parallel layer), alone
    or in a list or tuple. A plain function's experts are not found (nothing names them).

    Returns:
        the experts in the order found, each once.
    """
    owner = getattr(model, "__self__", model)
    holders = list(owner.modules()) if isinstance(owner, torch.nn.Module) else [owner]
    found: dict[int, SwiGLUExperts] = {}
    for holder in holders:
        for value in getattr(holder, "__dict__", {}).values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(item, SwiGLUExperts):
                    # the instance's own attribute: no property or __getattr__ runs
                    item = getattr(item, "__dict__", {}).get("experts")
                if isinstance(item, SwiGLUExperts):
                    found.setdefault(id(item), item)
    if not found:
        logger.debug("dbo: no SwiGLUExperts found in %s", type(owner).__name__)
    return list(found.values())
