"""dbo's all-to-all backends as transformers' own expert-parallel implementations (transformers >= 5.23).

Since 5.23, ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W, ep_size=W,
ep_implementation=NAME))`` loads an MoE checkpoint expert-parallel: each rank reads only its
``E / W`` experts of every layer from the checkpoint. How tokens reach the experts is pluggable
(``transformers.distributed.expert_parallel.EPImplementationInterface``): an implementation is
built once per experts module as ``cls(experts, ep_mesh, tp_mesh)`` and called, instead of the
experts, with ``(hidden_states [M, hidden], top_k_index [M, topk], top_k_weights [M, topk])``
(global expert ids, the routing the model's own router made) to return ``[M, hidden]``.

:class:`DBOExpertParallel` is such an implementation, one registered name per dbo backend
(:data:`EP_IMPLEMENTATIONS`, registered when :mod:`dbo.integrations.transformers` is imported):
its dispatch and combine run through a :class:`dbo.moe.MoEKernel` with the backend, the same
kernel :class:`~dbo.integrations.moe_block.ExpertParallelMoE` drives, so under DBO the ubatches
switch while a dispatch or combine is in flight. The experts that run on what arrived are the
model's own (:class:`~dbo.integrations.hf_experts.ModelExperts`: the experts module's forward, whatever
``experts_implementation`` it was loaded with), on this rank's local expert ids.

transformers wraps the whole model in FSDP2 for this (``fsdp_size=W``): the dense weights are
sharded and all-gathered before every layer, the experts modules (FSDP over one rank) copied into
a fresh buffer before every call, and FSDP's buffers made at the first forward fail under
``torch.inference_mode()``. Each implementation therefore has its model
:func:`~dbo.integrations.hf_fsdp.prepare_for_overlap`'d at its first forward
(:mod:`dbo.integrations.hf_fsdp`): the dense weights gathered once and kept whole, FSDP's buffers
made outside inference mode, so the model as ``from_pretrained`` returns it runs plain, under
inference mode and as overlapped ubatches. The experts stay sharded, and :class:`ModelExperts`
reads them when it runs, whichever copy FSDP has registered then.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from dbo.errors import DBOError
from dbo.integrations.backends import BACKENDS, make_backend
from dbo.integrations.hf_experts import ModelExperts, UnsupportedEPError
from dbo.integrations.hf_fsdp import prepare_at_first_forward, prepare_for_overlap
from dbo.integrations.moe_block import mask_routing
from dbo.moe import MoEKernel

__all__ = [
    "MIN_TRANSFORMERS",
    "DEEPEP_LL_MAX_TOKENS",
    "EP_IMPLEMENTATIONS",
    "TransformersVersionError",
    "UnsupportedEPError",
    "ep_interface",
    "ModelExperts",
    "DBOExpertParallel",
    "register_ep_implementation",
    "register_default_ep_implementations",
    "ep_distributed_config",
    "expert_parallel_modules",
    "expert_parallel_group",
    "switch_ep_backend",
    "prepare_for_overlap",
]

logger = logging.getLogger(__name__)

#: the first transformers release with ``EPImplementationInterface``
MIN_TRANSFORMERS = "5.23"

#: tokens per rank per call the registered ``dbo_deepep_ll`` takes: its receive buffers are
#: sized for it (and DeepEP caps them at 511 with NVSHMEM's default queue depth). Register
#: another with ``register_ep_implementation(name, "deepep_ll", max_tokens_per_rank=N)``.
DEEPEP_LL_MAX_TOKENS = 256

#: registered name -> (backend, backend kwargs)
EP_IMPLEMENTATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "dbo_naive": ("naive", {}),
    "dbo_all2all": ("all2all", {}),
    "dbo_copy_engine": ("copy_engine", {}),
    "dbo_deepep_ht": ("deepep_ht", {}),
    "dbo_deepep_ll": ("deepep_ll", {"max_tokens_per_rank": DEEPEP_LL_MAX_TOKENS}),
}


class TransformersVersionError(DBOError, ImportError):
    """The installed transformers has no expert-parallel implementation interface."""


def ep_interface() -> type:
    """transformers' ``EPImplementationInterface``.

    Raises:
        TransformersVersionError: transformers is missing or older than :data:`MIN_TRANSFORMERS`.
    """
    try:
        import transformers
    except ImportError as exc:
        raise TransformersVersionError(
            f"dbo's expert-parallel implementations need transformers >= {MIN_TRANSFORMERS}, which is "
            "not installed: pip install 'dbo[hf]' (or -e \".[hf]\")") from exc
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError as exc:
        raise TransformersVersionError(
            f"dbo's expert-parallel implementations (from_pretrained(..., distributed_config="
            f"DistributedConfig(ep_implementation='dbo_...'))) need transformers >= {MIN_TRANSFORMERS} "
            f"(EPImplementationInterface); transformers {transformers.__version__} is installed: "
            f"pip install 'transformers>={MIN_TRANSFORMERS}' accelerate. On older versions, "
            "convert_to_expert_parallel works on a model loaded whole") from exc
    return EPImplementationInterface


class DBOExpertParallel:
    """A transformers ``EPImplementation`` whose tokens move through a dbo backend.

    Subclasses (made by :func:`register_ep_implementation`) set :attr:`backend` and
    :attr:`backend_kwargs`. transformers builds one per experts module, during ``from_pretrained``
    (before the weights are loaded); the backend is built at the first call, when the hidden
    size, dtype, top-k and device are known (collective for copy_engine and DeepEP: every rank
    reaches each layer in the same order, as the MoE layers are collective anyway).

    Args:
        experts: the experts module, its ``num_experts`` already this rank's count.
        ep_mesh: the expert-parallel device mesh (its group is the backend's group).
        tp_mesh: the ranks that share a batch; must be one rank (dbo's backends exchange
            tokens between ranks that each hold their own batch).

    Raises:
        UnsupportedEPError: ``tp_size > 1``.
    """

    backend: ClassVar[str] = "all2all"
    backend_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, experts: torch.nn.Module, ep_mesh: Any, tp_mesh: Any):
        if tp_mesh.size() != 1:
            raise UnsupportedEPError(
                f"ep_implementation for dbo's {self.backend!r} needs tp_size=1 (each rank its own "
                f"batch), got a tensor-parallel group of {tp_mesh.size()}")
        self.ep_mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.num_local_experts = int(experts.num_experts)
        self.num_experts = self.num_local_experts * ep_mesh.size()
        self.first_expert = ep_mesh.get_local_rank() * self.num_local_experts
        self.experts = ModelExperts(experts, experts.forward)
        self.kernel: MoEKernel | None = None
        # the kernel's w1/w2: ModelExperts reads the module's weights itself (the same placeholder
        # every call, so the merged expert schedule sees one layer's ubatches as one call)
        self._no_weights = torch.empty(0)
        self._signature: tuple[Any, ...] | None = None
        # lets model-level helpers (prepare_for_overlap, expert_parallel_modules) find it
        experts._dbo_expert_parallel = self
        # transformers wraps the model in FSDP2 after this: keep its dense weights whole and make
        # its buffers outside inference mode at the model's first forward (hf_fsdp)
        prepare_at_first_forward(experts)

    def _build(self, x: torch.Tensor, topk: int) -> MoEKernel:
        pf = make_backend(self.backend, self.group, hidden=x.shape[1], num_experts=self.num_experts,
                          topk=topk, dtype=x.dtype, device=x.device, **self.backend_kwargs)
        self.ids_dtype = pf.topk_indices_dtype() or torch.int64
        logger.info("dbo: expert-parallel experts %d..%d of %d through %s", self.first_expert,
                    self.first_expert + self.num_local_experts - 1, self.num_experts, self.backend)
        return MoEKernel(pf, self.experts)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[M, hidden]`` (this rank's tokens), ``top_k_index`` ``[M, topk]``
        global expert ids, ``top_k_weights`` ``[M, topk]`` -> ``[M, hidden]``, the weighted sum
        of each token's experts, in ``hidden_states``'s dtype."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        signature = (x.shape[1], x.dtype, top_k_index.shape[-1], x.device)
        if self.kernel is None:
            self.kernel, self._signature = self._build(x, top_k_index.shape[-1]), signature
        elif signature != self._signature:
            raise ValueError(f"dbo's {self.backend!r} expert-parallel layer was built for (hidden, dtype, "
                             f"topk, device) = {self._signature}, called with {signature}")
        ids, weights = mask_routing(top_k_index.reshape(x.shape[0], -1).to(self.ids_dtype),
                                    top_k_weights.reshape(x.shape[0], -1).to(torch.float32))
        out = self.kernel(x, self._no_weights, self._no_weights, weights, ids,
                          global_num_experts=self.num_experts)
        return out.view(hidden_states.shape)

    def reset(self) -> None:
        """Drop per-ubatch state in the kernel and backend (after a failed step)."""
        if self.kernel is not None:
            self.kernel.reset()


def register_ep_implementation(name: str, backend: str, **backend_kwargs: Any) -> str:
    """Register dbo backend ``backend`` (built with ``backend_kwargs``) under ``name`` in
    transformers' ``EPImplementationInterface``; returns ``name``.

    Raises:
        ValueError: unknown backend.
        TransformersVersionError: transformers < :data:`MIN_TRANSFORMERS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {sorted(BACKENDS)}")
    interface = ep_interface()
    cls = type(f"DBOExpertParallel_{name}", (DBOExpertParallel,),
               {"backend": backend, "backend_kwargs": dict(backend_kwargs), "__module__": __name__})
    interface.register(name, cls)
    return name


def register_default_ep_implementations() -> list[str]:
    """Register every name of :data:`EP_IMPLEMENTATIONS`; returns them (an empty list, logged,
    on a transformers without the interface: conversion still works there)."""
    try:
        ep_interface()
    except TransformersVersionError as exc:
        logger.debug("dbo: no transformers expert-parallel implementations registered: %s", exc)
        return []
    return [register_ep_implementation(name, backend, **kw)
            for name, (backend, kw) in EP_IMPLEMENTATIONS.items()]


def ep_distributed_config(backend: str = "all2all", world_size: int | None = None) -> Any:
    """``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="dbo_<backend>")`` for
    ``from_pretrained``: every rank holds ``E / W`` whole experts and its own batch. The model it
    loads keeps its dense weights whole from its first forward on, which may run under
    ``torch.inference_mode()`` (:mod:`dbo.integrations.hf_fsdp`).

    Args:
        backend: a backend name (``"deepep_ht"``) or a registered implementation name.
        world_size: ``W`` (default: the default process group's size).

    Raises:
        TransformersVersionError: transformers < :data:`MIN_TRANSFORMERS`.
        ValueError: unknown backend; no process group and no ``world_size``.
    """
    ep_interface()
    from transformers.distributed import DistributedConfig

    name = backend if backend in EP_IMPLEMENTATIONS or backend.startswith("dbo_") else f"dbo_{backend}"
    if name not in EP_IMPLEMENTATIONS and name not in ep_interface()():
        raise ValueError(f"unknown backend {backend!r}; choose from "
                         f"{sorted(b for b, _ in EP_IMPLEMENTATIONS.values())}")
    if world_size is None:
        if not torch.distributed.is_initialized():
            raise ValueError("ep_distributed_config needs world_size or an initialized process group")
        world_size = torch.distributed.get_world_size()
    return DistributedConfig(fsdp_size=world_size, ep_size=world_size, ep_implementation=name)


def expert_parallel_modules(model: torch.nn.Module) -> list[tuple[str, DBOExpertParallel]]:
    """``(name, implementation)`` of every experts module of ``model`` that runs through one of
    dbo's implementations, in module order."""
    return [(name, m._dbo_expert_parallel) for name, m in model.named_modules()
            if isinstance(getattr(m, "_dbo_expert_parallel", None), DBOExpertParallel)]


def expert_parallel_group(model: torch.nn.Module) -> Any:
    """The expert-parallel process group of a model loaded with dbo's implementations, or None."""
    found = expert_parallel_modules(model)
    return found[0][1].group if found else None


def switch_ep_backend(model: torch.nn.Module, backend: str, **backend_kwargs: Any) -> torch.nn.Module:
    """Run every experts module that goes through dbo's implementations through ``backend``
    (built with ``backend_kwargs`` at its next call) from now on; returns ``model``. For
    comparing backends on one loaded model (the loaded weights stay where they are).

    Raises:
        ValueError: unknown backend, or no experts module runs through dbo's implementations.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {sorted(BACKENDS)}")
    found = expert_parallel_modules(model)
    if not found:
        raise ValueError("the model has no experts module running through dbo's expert-parallel "
                         "implementations: load it with ep_distributed_config(...)")
    for _, impl in found:
        impl.reset()
        impl.backend, impl.backend_kwargs = backend, dict(backend_kwargs)  # instance attributes
        impl.kernel, impl._signature = None, None
    return model


# importing this module (or dbo.integrations.transformers) registers the names; a no-op before 5.23
register_default_ep_implementations()
