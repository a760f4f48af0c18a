"""The library's experts: SwiGLU experts that implement :class:`dbo.moe.MoEExperts` in both
activation formats without a host sync on CUDA, their GPU kernels, and the trusted reference.

Layout: ``swiglu`` (:class:`SwiGLUExperts`, :func:`swiglu_expert`, :func:`find_swiglu_experts`)
with ``grouping`` (pairs sorted by expert on the device) and ``kernels`` (the Triton and Gluon
kernels: the fused experts, ``grouped_gemm``, ``gather_reduce``, ``batched``, their tiles; plain
torch where Triton is absent), ``reference`` (the single-process MoE the tests trust, expert
weights, the relative error). They stand above :mod:`dbo.moe` (the contract they implement) and
:mod:`dbo.kernels` (the launch helpers and row copies they share with it); nothing in
:mod:`dbo.moe` imports them.
"""

from dbo.experts.reference import (
    local_expert_weights,
    make_expert_weights,
    reference_moe,
    relative_error,
)
from dbo.experts.swiglu import SwiGLUExperts, find_swiglu_experts, swiglu_expert

__all__ = [
    "SwiGLUExperts",
    "swiglu_expert",
    "find_swiglu_experts",
    "reference_moe",
    "make_expert_weights",
    "local_expert_weights",
    "relative_error",
]
