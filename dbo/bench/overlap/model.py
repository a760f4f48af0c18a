"""The overlap benchmark's MoE model and the stand-ins that take parts of it away.

A step runs ``layers`` identical layers on token-major ``[M, hidden]`` activations: an attention
stand-in (RMSNorm, ``[hidden, attn_width]`` and ``[attn_width, hidden]`` matmuls), then an MoE
block (RMSNorm, linear gate + top-k router, routed SwiGLU experts behind a prepare/finalize
backend through :class:`dbo.moe.MoEKernel`, a shared SwiGLU expert run while the combine is in
flight). Every layer uses the same weights: the time is what matters, and one copy of a
DeepSeek-V3-sized expert set (11 GB per rank at 128 local experts) is enough.

The routed experts are the library's :class:`dbo.experts.SwiGLUExperts` (no host sync; on CUDA
grouped GEMMs and the Triton gather-reduce). What the benchmark swaps in to measure the parts:

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
    MoEExperts,
    MoEKernel,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    WorkspacePool,
    topk_route,
)
from dbo.overlap import mask_current_padding

__all__ = [
    "LayerDims",
    "BenchModel",
    "IdentityExperts",
    "RecordingPrepareAndFinalize",
    "ReplayPrepareAndFinalize",
]

logger = logging.getLogger(__name__)


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


# ---- stand-ins ---------------------------------------------------------------------------------


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
        self.rank, self.world_size = rank, world_size
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
        pool = WorkspacePool()  # the layers run one after another: one layer's scratch memory
        self.kernels = [MoEKernel(backend, experts, shared_experts=self.shared_expert, workspaces=pool)
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
