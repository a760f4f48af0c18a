"""The modular MoE layer: prepare/finalize backends, experts, the kernel that drives them."""

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
from dbo.moe.kernel import MoEKernel
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
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNoOp",
    "TopKWeightAndReduceDelegate",
]
