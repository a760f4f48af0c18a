"""The demo's small MoE transformer and its backend factory (shared by examples/*.py).

Each layer is an attention stand-in (norm, two matmuls; the compute an attention block would
do) followed by an MoE block (norm, top-k router, routed SwiGLU experts spread over the
expert-parallel group through a prepare/finalize backend, and a shared SwiGLU expert that runs
while the combine is in flight). Dense weights are replicated (same seed on every rank, as with
data-parallel attention); each rank holds its contiguous block of the routed experts.

Where the ubatches switch: the attention stand-in yields once, after its first matmul (on a GPU
its kernels are queued by then, so the other ubatch can queue its own work, or finish the
combine it left in flight, while these run); the MoE kernel yields after issuing each dispatch
and combine, so the other ubatch's attention and experts run while the all-to-all is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import dbo
from dbo.backends import BACKENDS, make_backend
from dbo.bench.dist import shutdown_distributed
from dbo.moe import (
    MoEKernel,
    PrepareAndFinalize,
    SwiGLUExperts,
    local_expert_weights,
    make_expert_weights,
    swiglu_expert,
    topk_route,
)
from dbo.overlap import mask_current_padding

__all__ = ["ModelConfig", "DemoMoEModel", "BACKENDS", "make_backend", "shutdown_distributed"]

@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 256
    intermediate: int = 256  #: per routed expert
    shared_intermediate: int = 256
    num_experts: int = 8
    topk: int = 2
    num_layers: int = 4
    dtype: torch.dtype = torch.float32
    seed: int = 0


def _randn(g: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


class AttentionStandIn(torch.nn.Module):
    """``x + W_o gelu(W_in norm(x))``: the compute of an attention block, on ``[M, hidden]``."""

    def __init__(self, cfg: ModelConfig, g: torch.Generator):
        super().__init__()
        h = cfg.hidden
        self.norm = torch.nn.RMSNorm(h, eps=1e-6)
        self.w_in = torch.nn.Parameter(_randn(g, h, 2 * h, scale=h ** -0.5), requires_grad=False)
        self.w_out = torch.nn.Parameter(_randn(g, 2 * h, h, scale=(2 * h) ** -0.5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with dbo.dbo_region("attention"):
            a = F.gelu(self.norm(x) @ self.w_in)
            dbo.dbo_yield()
            return x + a @ self.w_out


class MoEBlock(torch.nn.Module):
    """``x + routed(norm(x)) + shared(norm(x))`` with the routed experts behind ``backend``."""

    def __init__(self, cfg: ModelConfig, g: torch.Generator, backend: PrepareAndFinalize,
                 rank: int, world_size: int, layer: int):
        super().__init__()
        h = cfg.hidden
        self.cfg = cfg
        self.norm = torch.nn.RMSNorm(h, eps=1e-6)
        self.gate = torch.nn.Parameter(_randn(g, cfg.num_experts, h, scale=h ** -0.5),
                                       requires_grad=False)
        w1, w2 = make_expert_weights(cfg.num_experts, h, cfg.intermediate,
                                     seed=cfg.seed * 1000 + layer)
        self.w1 = torch.nn.Parameter(local_expert_weights(w1, rank, world_size), requires_grad=False)
        self.w2 = torch.nn.Parameter(local_expert_weights(w2, rank, world_size), requires_grad=False)
        si = cfg.shared_intermediate
        self.shared_w1 = torch.nn.Parameter(_randn(g, 2 * si, h, scale=h ** -0.5), requires_grad=False)
        self.shared_w2 = torch.nn.Parameter(_randn(g, h, si, scale=si ** -0.5), requires_grad=False)
        self.ids_dtype = backend.topk_indices_dtype() or torch.int32
        self.kernel = MoEKernel(backend, SwiGLUExperts(), shared_experts=self.shared_expert)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_expert(x, self.shared_w1, self.shared_w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        with dbo.dbo_region("router"):
            weights, ids = topk_route(h @ self.gate.t(), self.cfg.topk, ids_dtype=self.ids_dtype)
            ids, weights = mask_current_padding(ids, weights)  # padding rows: no expert
        return x + self.kernel(h, self.w1, self.w2, weights, ids,
                               global_num_experts=self.cfg.num_experts)


class DemoMoEModel(torch.nn.Module):
    """``num_layers`` x (attention stand-in, MoE block) on token-major ``[M, hidden]``.

    Args:
        cfg: sizes, dtype and seed.
        backends: one prepare/finalize backend per layer (from :func:`make_backend`).
        rank, world_size: this rank's place in the expert-parallel group.
    """

    def __init__(self, cfg: ModelConfig, backends: list[PrepareAndFinalize], rank: int,
                 world_size: int):
        super().__init__()
        if cfg.num_experts % world_size:
            raise ValueError(f"--experts ({cfg.num_experts}) must be a multiple of the world size "
                             f"({world_size})")
        if len(backends) != cfg.num_layers:
            raise ValueError(f"need one backend per layer ({cfg.num_layers}), got {len(backends)}")
        g = torch.Generator().manual_seed(cfg.seed)
        self.layers = torch.nn.ModuleList()
        for i, backend in enumerate(backends):
            self.layers.append(torch.nn.Sequential(
                AttentionStandIn(cfg, g), MoEBlock(cfg, g, backend, rank, world_size, i)))
        self.to(cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, hidden]`` in the model dtype -> ``[M, hidden]``."""
        for layer in self.layers:
            x = layer(x)
        return x

    def reset(self) -> None:
        """Drop per-ubatch state in every layer's kernel and backend (after a failed step)."""
        for layer in self.layers:
            layer[1].kernel.reset()
