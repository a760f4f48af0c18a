"""The modular MoE layer: the prepare/finalize contract and the kernel that drives a backend
and experts through it.

Layout: ``base`` (interfaces and result types), ``weight_and_reduce`` (the top-k
weight-and-reduce variants), ``kernel`` (:class:`MoEKernel`), ``merged`` (the merged expert
schedule: one experts call over every ubatch's rows), ``handles`` (per-ubatch state),
``comm_section`` (where a backend's communication runs), ``router`` (top-k routing),
``validate`` (argument checks), ``errors``.

The library's experts and the reference are a layer above, in :mod:`dbo.experts`; the
single-rank backend is :mod:`dbo.backends.local`. Their names stay importable from here
(``from dbo.moe import SwiGLUExperts, LocalPrepareAndFinalize, reference_moe``), kept for
compatibility: :func:`__getattr__` imports them on first use, so that importing ``dbo.moe``
never imports the layers above it.
"""

import importlib
from typing import Any

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
    WorkspacePool,
)
from dbo.moe.errors import MergedScheduleError, MoEProtocolError
from dbo.moe.handles import PerUBatch
from dbo.moe.kernel import MoEKernel
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
    "WorkspacePool",
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

#: the names that moved to the layers above, each with its home (see the module docstring)
_MOVED = {
    "SwiGLUExperts": "dbo.experts",
    "swiglu_expert": "dbo.experts",
    "reference_moe": "dbo.experts",
    "make_expert_weights": "dbo.experts",
    "local_expert_weights": "dbo.experts",
    "relative_error": "dbo.experts",
    "LocalPrepareAndFinalize": "dbo.backends.local",
}


def __getattr__(name: str) -> Any:
    """The names kept for compatibility (:data:`_MOVED`), imported from their homes on first use."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MOVED})
