"""The experts' GPU kernels (Triton and Gluon).

:mod:`dbo.experts.swiglu` (``SwiGLUExperts``) picks among them; nothing here knows about ubatches,
backends or the MoE layer's contract. Every module imports on a CPU-only install (without
Triton the callers take the plain-torch path).

* ``fused_experts``: the fused SwiGLU experts (routing, gate/up, down, top-k sum), the entry
  point :func:`fused_swiglu_experts` and :func:`prefer_fused` (where it beats the unfused steps);
* ``fused_kernels``: their Triton kernels; ``gluon_gate_up``: the warp-specialized Hopper
  gate/up kernel; ``fused_route``: the device-side sort of (token, slot) pairs by expert;
  ``fused_maps``: the row-tile maps the map-driven kernels walk; ``fused_tiles``: which tile
  each GEMM runs with, by shape (measured tables);
* ``grouped_gemm`` (:func:`grouped_mm`) and ``gather_reduce`` (activation, row gather, weighted
  reduction): the unfused steps;
* ``batched``: the BATCHED_EXPERTS slabs (and the merged schedule's segments of them) on the
  fused kernels.

They launch through :mod:`dbo.kernels.triton_launch`, below them (the row copies of
:mod:`dbo.kernels.row_copies` share it).
"""

from dbo.experts.kernels.fused_experts import fused_swiglu_experts, prefer_fused
from dbo.experts.kernels.gather_reduce import gather_reduce, gather_rows, silu_and_mul
from dbo.experts.kernels.grouped_gemm import grouped_mm

__all__ = ["fused_swiglu_experts", "prefer_fused", "grouped_mm", "gather_reduce", "gather_rows",
           "silu_and_mul"]
