"""The overlap benchmark's MoE model and the stand-ins that take parts of it away.

A step runs ``layers`` identical layers on token-major ``[M, hidden]`` activations: an attention
stand-in (RMSNorm, ``[hidden, attn_width]`` and ``[attn_width, hidden]`` matmuls), then an MoE
block (RMSNorm, linear gate + top-k router, routed SwiGLU experts behind a prepare/finalize
backend through :class:`dbo.moe.MoEKernel`, a shared SwiGLU expert run while the combine is in
flight). Every layer uses the same weights: the time is what matters, and one copy of a
DeepSeek-V3-sized expert set (11 GB per rank at 128 local experts) is enough.

What the benchmark swaps in to measure the parts:

* :class:`ChunkedSwiGLUExperts`: the routed experts as ``chunks`` groups of local experts, one
  group of kernels after the other, with no host sync (the expert row counts come from the
  backend's host-side counts). Chunks leave the GPU's block scheduler a kernel boundary at
  which the communication kernels can take SMs.
* :class:`IdentityExperts`: hands the received tokens straight to the combine ("communication
  alone").
* :class:`RecordingPrepareAndFinalize` / :class:`ReplayPrepareAndFinalize`: record what the
  real backend delivered in one step, then replay it with no communication at all ("compute
  alone": the same expert kernels on the same received tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import dbo
from dbo.moe import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEExperts,
    MoEKernel,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    topk_route,
)
from dbo.overlap import mask_current_padding

__all__ = [
    "LayerDims",
    "BenchModel",
    "ChunkedSwiGLUExperts",
    "IdentityExperts",
    "RecordingPrepareAndFinalize",
    "ReplayPrepareAndFinalize",
]

logger = logging.getLogger(__name__)

_grouped_mm = getattr(torch, "_grouped_mm", None)

try:  # the weighted gather-reduce of the STANDARD experts' output (CUDA only)
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the embedding_bag reduction is used
    triton = None

if triton is not None:

    @triton.jit
    def _gather_reduce_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, hidden,
                              TOPK: tl.constexpr, BLOCK: tl.constexpr):
        """out[m, :] = sum over slots s of w[m, s] * y[pos[m, s], :] (float32 accumulation);
        a slot with weight 0 (routed to another rank) reads nothing."""
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            w = tl.load(w_ptr + m * TOPK + s)
            if w != 0.0:
                row = tl.load(pos_ptr + m * TOPK + s).to(tl.int64)
                acc += w * tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_reduce(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[m] = sum_s weights[m, s] * y[pos[m, s]]``: ``y [P, hidden]``, ``pos [M, topk]``
    int64, ``weights [M, topk]`` float32 (0 for a slot to skip). One Triton kernel on CUDA
    (each output row reads only its own slots' rows: no atomics, no ``[M, topk, hidden]``
    intermediate); ``F.embedding_bag`` elsewhere."""
    m, topk = pos.shape
    hidden = y.shape[1]
    if triton is None or not y.is_cuda:
        return F.embedding_bag(pos, y, mode="sum", per_sample_weights=weights.to(y.dtype))
    out = torch.empty(m, hidden, dtype=y.dtype, device=y.device)
    if m:
        block = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
        _gather_reduce_kernel[(m, triton.cdiv(hidden, block))](
            y.contiguous(), pos.contiguous(), weights.float().contiguous(), out, hidden,
            TOPK=topk, BLOCK=block)
    return out


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one layer. ``intermediate``: per routed expert; ``attn_width``: the attention
    stand-in's inner width (its cost is ``4 * M * hidden * attn_width`` flops)."""

    hidden: int
    intermediate: int
    shared_intermediate: int
    num_experts: int
    topk: int
    attn_width: int
    layers: int
    dtype: torch.dtype
    attn_yield: bool = False

    def flops_per_token(self) -> dict[str, float]:
        """Matmul flops per token of one layer, by part (routed counts ``topk`` experts)."""
        h = self.hidden
        return {
            "attention": 4.0 * h * self.attn_width,
            "router": 2.0 * h * self.num_experts,
            "routed_experts": 2.0 * self.topk * h * 3 * self.intermediate,
            "shared_expert": 2.0 * h * 3 * self.shared_intermediate,
        }


# ---- experts ----------------------------------------------------------------------------------


def _split_even(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class ChunkedSwiGLUExperts(MoEExperts):
    """SwiGLU experts (``y = w2 @ (silu(g) * u)``, ``[g; u] = w1 @ x``) in ``chunks`` groups of
    local experts, each group its own kernels.

    STANDARD format (deepep_ht, naive, all2all): the (token, slot) pairs routed to a local
    expert are sorted by expert on the device; the number of pairs per expert comes from
    ``expert_tokens_meta.expert_num_tokens_cpu`` when the backend has it (DeepEP normal mode
    does), so nothing reads the GPU back; otherwise it is read back once per call (a sync).
    (Experts are contiguous after the sort, so group ``[e0, e1)`` is rows ``[start(e0),
    start(e1))`` and its grouped-GEMM offsets are host arithmetic.)
    Each group runs two ``torch._grouped_mm`` (CUDA, bf16) or a loop over its experts. The
    weighted reduction over each token's local slots is one gather-reduce kernel
    (:func:`gather_reduce`: Triton on CUDA, ``embedding_bag`` elsewhere; float32 accumulation, no
    atomics): each token's output row sums the expert-output rows of its slots, weighted by the
    router; slots of other ranks' experts weigh 0. (Until 2026-11-22 it was a bf16 ``index_add_``,
    whose atomics took about a third of the layer's compute on an H200; then ``embedding_bag``,
    whose CUDA kernel was as slow; ``reduce="index_add"`` keeps the first.) Output
    ``[M, hidden]``, already weighted and reduced (``TopKWeightAndReduceNoOp``).

    BATCHED_EXPERTS format (deepep_ll): ``[L, cap, hidden]`` slabs; each group runs two
    ``bmm`` over the first ``rows`` rows of its experts' slabs (default all ``cap``).
    ``rows`` plays the part of a masked grouped GEMM's expected rows (DeepGEMM's
    ``expected_m``): the benchmark sets it to the most tokens any expert received, so the
    padding of the capacity is not computed. Output ``[L, cap, hidden]``, rows past ``rows``
    unwritten (the combine reads only each expert's received rows).

    Args:
        chunks: number of expert groups (1 = one launch sequence over all experts).
        rows: BATCHED_EXPERTS rows computed per expert (None: the whole capacity).
        use_grouped_mm: use ``torch._grouped_mm`` on CUDA bf16 (default: when available).
        reduce: STANDARD format's weighted reduction, ``"gather"`` (default:
            :func:`gather_reduce`) or ``"index_add"``.
    """

    def __init__(self, chunks: int = 1, *, rows: int | None = None,
                 use_grouped_mm: bool | None = None, reduce: str = "gather"):
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if reduce not in ("gather", "index_add"):
            raise ValueError(f"reduce must be 'gather' or 'index_add', got {reduce!r}")
        self.chunks = chunks
        self.reduce = reduce
        self.rows = rows
        self.use_grouped_mm = _grouped_mm is not None if use_grouped_mm is None else use_grouped_mm
        self.observe = False  #: track the most rows any expert received (BATCHED) / check counts
        self.max_rows_seen: torch.Tensor | None = None
        self.host_count_reads = 0  #: calls that had to read the counts back from the device
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self):
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        return TopKWeightAndReduceNoOp()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, *, activation_format,
              expert_tokens_meta, apply_router_weight_on_input, workspace):
        if apply_router_weight_on_input:
            raise ValueError("ChunkedSwiGLUExperts weights the outputs; apply_router_weight_on_input "
                             "is not supported")
        self._format = activation_format
        if activation_format is ActivationFormat.BATCHED_EXPERTS:
            return self._batched(hidden_states, w1, w2, expert_tokens_meta)
        return self._standard(hidden_states, w1, w2, topk_weights, topk_ids, expert_tokens_meta)

    def _note_rows(self, counts: torch.Tensor) -> None:
        m = counts.max().to(torch.int64).reshape(1)
        self.max_rows_seen = m if self.max_rows_seen is None else torch.maximum(self.max_rows_seen, m)

    # ---- STANDARD -------------------------------------------------------------------------

    def _standard(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  meta: ExpertTokensMetadata | None) -> torch.Tensor:
        m, hidden = x.shape
        n_local = w1.shape[0]
        topk = topk_ids.shape[1]
        key = topk_ids.reshape(-1).to(torch.int64)
        key = torch.where(key >= 0, key, n_local)  # slots of other ranks' experts sort last
        sorted_key, order = torch.sort(key, stable=True)
        counts = None
        if meta is not None and meta.expert_num_tokens_cpu is not None \
                and meta.expert_num_tokens_cpu.numel() == n_local:
            counts = [int(c) for c in meta.expert_num_tokens_cpu.tolist()]
        if counts is None or self.observe:
            ends = torch.searchsorted(sorted_key, torch.arange(1, n_local + 1, device=x.device))
            dev_counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
            if counts is not None and counts != dev_counts:
                raise RuntimeError(f"the backend's host-side expert counts {counts[:8]}... differ from "
                                   f"the routed pairs {dev_counts[:8]}...")
            if counts is None:
                self.host_count_reads += 1
            counts = dev_counts
        total = sum(counts)
        if total == 0:
            return torch.zeros(m, hidden, dtype=x.dtype, device=x.device)
        pairs = order[:total]
        tokens = pairs // topk
        xs = x.index_select(0, tokens)
        gather = self.reduce == "gather"
        ws = None
        if not gather:
            # the router weight scales the down projection's input rows (a linear map), which
            # are intermediate-wide, not hidden-wide
            ws = topk_weights.reshape(-1).index_select(0, pairs).to(x.dtype).unsqueeze(1)
        grouped = (x.is_cuda and x.dtype == torch.bfloat16 and self.use_grouped_mm
                   and _grouped_mm is not None and hidden % 8 == 0 and w2.shape[2] % 8 == 0)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        groups = _split_even(n_local, self.chunks)
        if grouped:
            # every group's offsets (its experts' row ends, from the group's first row) in one
            # pinned, non-blocking copy: no sync, one launch
            rel = [starts[e + 1] - starts[e0] for e0, e1 in groups for e in range(e0, e1)]
            offs_all = torch.tensor(rel, dtype=torch.int32).pin_memory().to(x.device, non_blocking=True)
        acc = None if gather else torch.zeros(m, hidden, dtype=x.dtype, device=x.device)
        ys: list[torch.Tensor] = []
        for e0, e1 in groups:
            r0, r1 = starts[e0], starts[e1]
            if r1 == r0:
                continue
            a_scale = None if ws is None else ws[r0:r1]
            if grouped:
                offs = offs_all[e0:e1]
                h = _grouped_mm(xs[r0:r1], w1[e0:e1].transpose(1, 2), offs=offs)
                gate, up = h.chunk(2, dim=-1)
                a = F.silu(gate) * up
                y = _grouped_mm(a if a_scale is None else a * a_scale, w2[e0:e1].transpose(1, 2),
                                offs=offs)
            else:
                y = torch.empty(r1 - r0, hidden, dtype=x.dtype, device=x.device)
                for e in range(e0, e1):
                    a0, b0 = starts[e], starts[e + 1]
                    if b0 > a0:
                        gate, up = (xs[a0:b0] @ w1[e].t()).chunk(2, dim=-1)
                        a = F.silu(gate) * up
                        if ws is not None:
                            a = a * ws[a0:b0]
                        y[a0 - r0:b0 - r0] = a @ w2[e].t()
            if gather:
                ys.append(y)
            else:
                # bf16 atomics on GPUs
                acc.index_add_(0, tokens[r0:r1], y)
        if not gather:
            return acc
        y_all = ys[0] if len(ys) == 1 else torch.cat(ys)
        # token t's output sums the rows of y_all that hold its slots' outputs; a slot routed
        # to another rank points at row 0 with weight 0
        flat = m * topk
        pos = torch.zeros(flat, dtype=torch.int64, device=x.device)
        pos[pairs] = torch.arange(total, device=x.device)
        weights = torch.zeros(flat, dtype=torch.float32, device=x.device)
        weights[pairs] = topk_weights.reshape(-1).index_select(0, pairs).float()
        return gather_reduce(y_all, pos.view(m, topk), weights.view(m, topk))

    # ---- BATCHED_EXPERTS ------------------------------------------------------------------

    def _batched(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 meta: ExpertTokensMetadata | None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"BATCHED_EXPERTS activations must be [L, cap, hidden], got {tuple(x.shape)}")
        n_local, cap, hidden = x.shape
        if self.observe and meta is not None:
            self._note_rows(meta.expert_num_tokens)
        rows = cap if self.rows is None else max(1, min(self.rows, cap))
        out = torch.empty(n_local, cap, hidden, dtype=x.dtype, device=x.device)
        for e0, e1 in _split_even(n_local, self.chunks):
            h = torch.bmm(x[e0:e1, :rows], w1[e0:e1].transpose(1, 2))
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
            if rows == cap:
                torch.bmm(a, w2[e0:e1].transpose(1, 2), out=out[e0:e1])
            else:
                out[e0:e1, :rows] = torch.bmm(a, w2[e0:e1].transpose(1, 2))
        return out


class IdentityExperts(MoEExperts):
    """No expert computation: the received activations go straight back to the combine."""

    def __init__(self) -> None:
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self):
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        return TopKWeightAndReduceNoOp()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, *, activation_format,
              expert_tokens_meta, apply_router_weight_on_input, workspace):
        self._format = activation_format
        return hidden_states


# ---- record and replay ------------------------------------------------------------------------


class _CallKeys:
    """``(ubatch, n-th prepare of this ubatch in the step)``: which layer's dispatch this is."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}

    def reset(self) -> None:
        self._calls.clear()

    def next(self) -> tuple[int, int]:
        ub = dbo.dbo_current_ubatch_id()
        k = self._calls.get(ub, 0)
        self._calls[ub] = k + 1
        return ub, k


class _Delegating(PrepareAndFinalize):
    def __init__(self, like: PrepareAndFinalize):
        self.like = like

    @property
    def activation_format(self) -> ActivationFormat:
        return self.like.activation_format

    def topk_indices_dtype(self):
        return self.like.topk_indices_dtype()

    def max_num_tokens_per_rank(self):
        return self.like.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return self.like.num_dispatchers()

    def output_is_reduced(self) -> bool:
        return self.like.output_is_reduced()


class RecordingPrepareAndFinalize(_Delegating):
    """Runs the real backend and keeps every :class:`PrepareResult` it delivered, keyed by
    ``(ubatch, call index)``. Call :meth:`begin_step` before each step."""

    def __init__(self, inner: PrepareAndFinalize):
        super().__init__(inner)
        self.records: dict[tuple[int, int], PrepareResult] = {}
        self._keys = _CallKeys()

    def begin_step(self) -> None:
        self._keys.reset()

    def supports_async(self) -> bool:
        return self.like.supports_async()

    def reset(self) -> None:
        self.like.reset()

    def prepare(self, *args: Any, **kwargs: Any) -> PrepareResult:
        key = self._keys.next()
        res = self.like.prepare(*args, **kwargs)
        self.records[key] = res
        return res

    def prepare_async(self, *args: Any, **kwargs: Any):
        key = self._keys.next()
        res = self.like.prepare_async(*args, **kwargs)
        hook, receiver = res if isinstance(res, tuple) else (None, res)

        def record() -> PrepareResult:
            out = receiver()
            self.records[key] = out
            return out

        return record if hook is None else (hook, record)

    def finalize(self, *args: Any, **kwargs: Any) -> None:
        self.like.finalize(*args, **kwargs)

    def finalize_async(self, *args: Any, **kwargs: Any):
        return self.like.finalize_async(*args, **kwargs)


def _noop() -> None:
    return None


class ReplayPrepareAndFinalize(_Delegating):
    """Delivers recorded :class:`PrepareResult` objects instead of communicating; finalize
    only zeroes the output. Returns ``(hook, receiver)`` pairs, so under DBO the kernel yields
    where a real backend would have its all-to-all in flight."""

    def __init__(self, like: PrepareAndFinalize, records: dict[tuple[int, int], PrepareResult]):
        super().__init__(like)
        self.records = records
        self._keys = _CallKeys()

    def begin_step(self) -> None:
        self._keys.reset()

    def supports_async(self) -> bool:
        return True

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        res = self.records[self._keys.next()]
        return _noop, (lambda: res)

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce):
        output.zero_()
        return _noop, _noop


# ---- the model ----------------------------------------------------------------------------------


def _randn(shape: tuple[int, ...], scale: float, dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, dtype=torch.float32 if dtype != torch.bfloat16 else dtype,
                    device=device, generator=gen)
    return t.mul_(scale).to(dtype)


class BenchModel:
    """``layers`` x (attention stand-in, MoE block) with one set of weights (see the module
    docstring). ``use(backend, experts)`` builds the layers' kernels around a backend.

    Args:
        dims: layer sizes and dtype.
        rank, world_size: this rank's place in the expert-parallel group.
        device: where the weights live (generated there, from ``seed``).
    """

    def __init__(self, dims: LayerDims, rank: int, world_size: int, device: torch.device,
                 seed: int = 0):
        if dims.num_experts % world_size:
            raise ValueError(f"num_experts ({dims.num_experts}) must be a multiple of the world size "
                             f"({world_size})")
        self.dims = dims
        h, dt = dims.hidden, dims.dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        self.attn_norm = torch.ones(h, dtype=dt, device=device)
        self.moe_norm = torch.ones(h, dtype=dt, device=device)
        self.w_in = _randn((h, dims.attn_width), h ** -0.5, dt, device, gen)
        self.w_out = _randn((dims.attn_width, h), dims.attn_width ** -0.5, dt, device, gen)
        self.gate = _randn((dims.num_experts, h), h ** -0.5, dt, device, gen)
        si = dims.shared_intermediate
        self.shared_w1 = _randn((2 * si, h), h ** -0.5, dt, device, gen)
        self.shared_w2 = _randn((h, si), si ** -0.5, dt, device, gen)
        n_local = dims.num_experts // world_size
        gen.manual_seed(seed * 1009 + 17 * rank + 1)  # this rank's own experts
        self.w1 = _randn((n_local, 2 * dims.intermediate, h), h ** -0.5, dt, device, gen)
        self.w2 = _randn((n_local, h, dims.intermediate), dims.intermediate ** -0.5, dt, device, gen)
        self.kernels: list[MoEKernel] = []
        self.routing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def use(self, backend: PrepareAndFinalize, experts: MoEExperts) -> BenchModel:
        """Route every layer's experts through ``backend`` and ``experts``."""
        self.kernels = [MoEKernel(backend, experts, shared_experts=self.shared_expert)
                        for _ in range(self.dims.layers)]
        return self

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.shared_w1.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.shared_w2.t()

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        with dbo.dbo_region("attention"):
            a = F.gelu(F.rms_norm(x, (x.shape[1],), self.attn_norm, 1e-6) @ self.w_in)
            if self.dims.attn_yield:
                dbo.dbo_yield()
            return x + a @ self.w_out

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        x = self._attention(x)
        h = F.rms_norm(x, (x.shape[1],), self.moe_norm, 1e-6)
        kernel = self.kernels[i]
        with dbo.dbo_region("router"):
            ids_dtype = kernel.prepare_finalize.topk_indices_dtype() or torch.int32
            weights, ids = topk_route(h @ self.gate.t(), self.dims.topk, ids_dtype=ids_dtype)
            ids, weights = mask_current_padding(ids, weights)
        if self.routing is not None:
            self.routing.append((h, weights, ids))
        return x + kernel(h, self.w1, self.w2, weights, ids, global_num_experts=self.dims.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, hidden]`` in the model dtype -> ``[M, hidden]``."""
        for i in range(self.dims.layers):
            x = self.layer(i, x)
        return x

    __call__ = forward

    def record_routing(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Run one plain forward and return each layer's ``(normed input, weights, ids)``."""
        self.routing = []
        try:
            self.forward(x)
            return self.routing
        finally:
            self.routing = None

    def comm_step(self, kernels: list[MoEKernel],
                  routing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable[[], Any]:
        """A step of dispatch + combine only: each layer's recorded routing through
        ``kernels`` (built on :class:`IdentityExperts`)."""
        def step() -> torch.Tensor:
            out = None
            for kernel, (h, weights, ids) in zip(kernels, routing, strict=True):
                out = kernel(h, self.w1, self.w2, weights, ids, global_num_experts=self.dims.num_experts)
            return out

        return step
