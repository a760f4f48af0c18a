"""The modular MoE layer: prepare/finalize backends, experts, the kernel that drives them.

Layout: ``base`` (interfaces and result types), ``weight_and_reduce`` (the top-k
weight-and-reduce variants), ``kernel`` (:class:`MoEKernel`), ``experts`` (the SwiGLU experts,
without host syncs on CUDA) with ``grouping`` (pairs sorted by expert on the device) and
``kernels`` (the GPU kernels: the fused experts, ``grouped_gemm`` and ``gather_reduce``, their
tiles and launch helpers; plain torch where Triton is absent), ``router`` (top-k
routing), ``local`` (a single-rank backend), ``reference`` (the trusted single-process MoE),
``validate`` (argument checks), ``handles`` (per-ubatch state), ``merged`` (the merged expert
schedule: one experts call over every ubatch's rows).
"""

from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    FinalizeAsyncResult,
    MoEExperts,
    PrepareAndFinalize,
    PrepareAsyncResult,
    PrepareResult,
    Receiver,
    Workspace,
)
from dbo.moe.errors import MergedScheduleError, MoEProtocolError
from dbo.moe.experts import SwiGLUExperts, swiglu_expert
from dbo.moe.handles import PerUBatch
from dbo.moe.kernel import MoEKernel
from dbo.moe.local import LocalPrepareAndFinalize
from dbo.moe.reference import (
    local_expert_weights,
    make_expert_weights,
    reference_moe,
    relative_error,
)
from dbo.moe.router import TopKRouter, topk_route
from dbo.moe.validate import (
    ACTIVATION_DTYPES,
    IdsRangeCheck,
    check_expert_weights,
    check_routing_inputs,
    contiguous_expert_map,
    num_local_experts_for,
)
from dbo.moe.weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
)

__all__ = [
    "ActivationFormat",
    "ExpertTokensMetadata",
    "PrepareResult",
    "Receiver",
    "PrepareAsyncResult",
    "FinalizeAsyncResult",
    "PrepareAndFinalize",
    "MoEExperts",
    "Workspace",
    "MoEKernel",
    "MoEProtocolError",
    "MergedScheduleError",
    "PerUBatch",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNoOp",
    "TopKWeightAndReduceDelegate",
    "SwiGLUExperts",
    "swiglu_expert",
    "LocalPrepareAndFinalize",
    "TopKRouter",
    "topk_route",
    "reference_moe",
    "make_expert_weights",
    "local_expert_weights",
    "relative_error",
    "ACTIVATION_DTYPES",
    "check_routing_inputs",
    "IdsRangeCheck",
    "check_expert_weights",
    "contiguous_expert_map",
    "num_local_experts_for",
]
