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
kernel :class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` drives, so under DBO the ubatches
switch while a dispatch or combine is in flight. The experts that run on what arrived
(:mod:`dbo.integrations.transformers.experts`) are dbo's library experts on the module's own weights
(:class:`~dbo.integrations.transformers.experts.LibraryExperts`, which skip the slots whose expert is on
another rank) where its layout allows, or the module's own forward
(:class:`~dbo.integrations.transformers.experts.ModelExperts`, whatever ``experts_implementation``), as
chosen by ``ep_distributed_config(backend, experts=...)`` or
:func:`~dbo.integrations.transformers.ep_model.switch_ep_experts`.

transformers wraps the whole model in FSDP2 for this (``fsdp_size=W``): the dense weights are
sharded and all-gathered before every layer, the experts modules (FSDP over one rank) copied into
a fresh buffer before every call, and FSDP's buffers made at the first forward fail under
``torch.inference_mode()``. Each implementation therefore has its model
:func:`~dbo.integrations.transformers.fsdp.prepare_for_overlap`'d at its first forward
(:mod:`dbo.integrations.transformers.fsdp`): the dense weights gathered once and kept whole, FSDP's buffers
made outside inference mode, so the model as ``from_pretrained`` returns it runs plain, under
inference mode and as overlapped ubatches. The experts stay sharded, and both kinds of experts
read them when they run, whichever copy FSDP has registered then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, ClassVar

import torch

from dbo.backends import backend_spec, make_backend
from dbo.deployment import DeploymentConfig, load_deployment_config
from dbo.errors import DBOError
from dbo.integrations.transformers.checkpoint import check_checkpoint_being_loaded
from dbo.integrations.transformers.decode_phase import (
    DEEPEP_LL_MAX_TOKENS,
    checked_decode_kwargs,
    decode_phase,
    decoding,
)
from dbo.integrations.transformers.experts import (
    EXPERTS_CHOICES,
    LibraryExperts,
    ModelExperts,
    UnsupportedEPError,
    make_experts,
)
from dbo.integrations.transformers.fsdp import prepare_at_first_forward, prepare_for_overlap
from dbo.integrations.transformers.moe_block import mask_routing
from dbo.moe import MoEKernel, WorkspacePool

__all__ = [
    "MIN_TRANSFORMERS",
    "DEEPEP_LL_MAX_TOKENS",
    "EP_IMPLEMENTATIONS",
    "TransformersVersionError",
    "EXPERTS_CHOICES",
    "UnsupportedEPError",
    "ep_interface",
    "ModelExperts",
    "LibraryExperts",
    "DBOExpertParallel",
    "decode_phase",
    "register_ep_implementation",
    "register_default_ep_implementations",
    "ep_distributed_config",
    "prepare_for_overlap",
]

logger = logging.getLogger(__name__)

#: the first transformers release with ``EPImplementationInterface``
MIN_TRANSFORMERS = "5.23"

#: registered name -> (backend, backend kwargs); ``dbo_deepep_ll`` takes
#: :data:`~dbo.integrations.transformers.decode_phase.DEEPEP_LL_MAX_TOKENS` tokens per call.
#: ``dbo_deepep`` is DeepEP's usual pairing (as SGLang's ``--deepep-mode auto``): high-throughput
#: kernels for the prefill, low-latency ones for the decode steps (:func:`decode_phase`;
#: ``decode_backend`` / ``decode_backend_kwargs`` there).
EP_IMPLEMENTATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "dbo_naive": ("naive", {}),
    "dbo_all2all": ("all2all", {}),
    "dbo_copy_engine": ("copy_engine", {}),
    "dbo_deepep_ht": ("deepep_ht", {}),
    "dbo_deepep_ll": ("deepep_ll", {"max_tokens_per_rank": DEEPEP_LL_MAX_TOKENS}),
    "dbo_deepep": ("deepep_ht", {"decode_backend": "deepep_ll"}),
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

    Subclasses (made by :func:`register_ep_implementation`) set :attr:`backend`,
    :attr:`backend_kwargs` and :attr:`experts_choice` (one of :data:`EXPERTS_CHOICES`; the
    instance's :attr:`experts_kind` says which it runs: ``"library"`` or ``"model"``).
    transformers builds one per experts module, during ``from_pretrained`` (before the weights
    are loaded); the backend is built at the first call, when the hidden
    size, dtype, top-k and device are known (collective for copy_engine and DeepEP: every rank
    reaches each layer in the same order, as the MoE layers are collective anyway).

    Args:
        experts: the experts module, its ``num_experts`` already this rank's count.
        ep_mesh: the expert-parallel device mesh (its group is the backend's group).
        tp_mesh: the ranks that share a batch; must be one rank (dbo's backends exchange
            tokens between ranks that each hold their own batch).

    Raises:
        UnsupportedEPError: ``tp_size > 1``; ``experts_choice == "library"`` for experts the
            library experts cannot run.
    """

    backend: ClassVar[str] = "all2all"
    backend_kwargs: ClassVar[dict[str, Any]] = {}
    experts_choice: ClassVar[str] = "auto"
    #: the backend of the calls made inside :func:`decode_phase` (None: :attr:`backend` there too)
    decode_backend: ClassVar[str | None] = None
    decode_backend_kwargs: ClassVar[dict[str, Any]] = {}
    #: the tuned deployment the model was loaded for (:func:`ep_distributed_config`'s
    #: ``deployment``), which :class:`DBOPrefill` runs by default; None: none
    deployment: ClassVar[DeploymentConfig | None] = None

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
        # its own forward, before transformers replaces module.forward with this implementation's
        self._module, self._module_forward = experts, experts.forward
        self.experts, self.experts_kind = make_experts(experts, experts.forward, self.experts_choice)
        self.kernel: MoEKernel | None = None
        self.decode_kernel: MoEKernel | None = None  # the decode backend's, built at its first call
        # the kernel's w1/w2: the experts read the module's weights themselves (the same placeholder
        # every call, so the merged expert schedule sees one layer's ubatches as one call)
        self._no_weights = torch.empty(0)
        self._signature: tuple[Any, ...] | None = None
        # lets model-level helpers (prepare_for_overlap, expert_parallel_modules) find it
        experts._dbo_expert_parallel = self
        # before any rank reads its experts: a broken file or expert stops every rank here
        check_checkpoint_being_loaded(self.num_experts, self.group)
        # transformers wraps the model in FSDP2 after this: keep its dense weights whole and make
        # its buffers outside inference mode at the model's first forward (hf_fsdp)
        prepare_at_first_forward(experts)

    def _build(self, x: torch.Tensor, topk: int, backend: str, kwargs: dict[str, Any]
               ) -> tuple[MoEKernel, torch.dtype]:
        """A kernel through ``backend`` and the dtype its expert ids take."""
        pf = make_backend(backend, self.group, hidden=x.shape[1], num_experts=self.num_experts,
                          topk=topk, dtype=x.dtype, device=x.device, **kwargs)
        logger.info("dbo: expert-parallel experts %d..%d of %d through %s", self.first_expert,
                    self.first_expert + self.num_local_experts - 1, self.num_experts, backend)
        return (MoEKernel(pf, self.experts, workspaces=WorkspacePool.of_device(x.device)),
                pf.topk_indices_dtype() or torch.int64)

    def _kernel(self, x: torch.Tensor, topk: int) -> tuple[MoEKernel, torch.dtype]:
        """The kernel of this call and its ids' dtype: the decode backend's inside
        :func:`decode_phase` (where one is set), else the backend's; built at its first call."""
        signature = (x.shape[1], x.dtype, topk, x.device)
        if self._signature is None:
            self._signature = signature
        elif signature != self._signature:
            raise ValueError(f"dbo's {self.backend!r} expert-parallel layer was built for (hidden, dtype, "
                             f"topk, device) = {self._signature}, called with {signature}")
        if self.decode_backend is not None and decoding():
            if self.decode_kernel is None:
                self.decode_kernel, self._decode_ids_dtype = self._build(
                    x, topk, self.decode_backend, self.decode_backend_kwargs)
            return self.decode_kernel, self._decode_ids_dtype
        if self.kernel is None:
            self.kernel, self._ids_dtype = self._build(x, topk, self.backend, self.backend_kwargs)
        return self.kernel, self._ids_dtype

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[M, hidden]`` (this rank's tokens), ``top_k_index`` ``[M, topk]``
        global expert ids, ``top_k_weights`` ``[M, topk]`` -> ``[M, hidden]``, the weighted sum
        of each token's experts, in ``hidden_states``'s dtype."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        kernel, ids_dtype = self._kernel(x, top_k_index.shape[-1])
        ids, weights = mask_routing(top_k_index.reshape(x.shape[0], -1).to(ids_dtype),
                                    top_k_weights.reshape(x.shape[0], -1).to(torch.float32))
        out = kernel(x, self._no_weights, self._no_weights, weights, ids,
                     global_num_experts=self.num_experts)
        return out.view(hidden_states.shape)

    def reset(self) -> None:
        """Drop per-ubatch state in the kernel and backend (after a failed step)."""
        for kernel in (self.kernel, self.decode_kernel):
            if kernel is not None:
                kernel.reset()

    def switch_backend(self, name: str, *, group: Any = None, decode_backend: str | None = None,
                       decode_backend_kwargs: dict[str, Any] | None = None, **options: Any) -> None:
        """Move this module's tokens through backend ``name`` (built with ``options`` at its next
        call), and inside :func:`decode_phase` through ``decode_backend`` (None: ``name``); the
        weights stay where they are. Entry: :func:`dbo.integrations.transformers.use_backend`.
        Raises ValueError for an unknown backend or a ``group`` (a loaded model keeps its own)."""
        if group is not None:
            raise ValueError("group: a model loaded with ep_distributed_config(...) keeps the group it "
                             "was loaded on; leave group=None")
        backend_spec(name)
        decode_kwargs = checked_decode_kwargs(decode_backend, decode_backend_kwargs)
        self.reset()  # then instance attributes, over register_ep_implementation's class defaults
        self.backend, self.backend_kwargs = name, dict(options)
        self.decode_backend, self.decode_backend_kwargs = decode_backend, dict(decode_kwargs)
        self.kernel, self.decode_kernel, self._signature = None, None, None

    def set_experts(self, choice: str) -> str:
        """Run ``choice`` (:data:`EXPERTS_CHOICES`) from the next call on, on the same backend;
        returns the kind now run (``"library"`` or ``"model"``).

        Raises:
            ValueError: unknown choice.
            UnsupportedEPError: ``"library"`` for experts the library experts cannot run.
        """
        experts, kind = make_experts(self._module, self._module_forward, choice)
        self.reset()
        self.experts, self.experts_kind = experts, kind
        if self.kernel is not None:
            self.kernel = MoEKernel(self.kernel.prepare_finalize, experts,
                                    workspaces=self.kernel.workspaces)
        if self.decode_kernel is not None:
            self.decode_kernel = MoEKernel(self.decode_kernel.prepare_finalize, experts,
                                           workspaces=self.decode_kernel.workspaces)
        return kind


def check_experts_choice(experts: str) -> None:
    if experts not in EXPERTS_CHOICES:
        raise ValueError(f"experts must be one of {EXPERTS_CHOICES}, got {experts!r}")


def register_ep_implementation(name: str, backend: str, *, experts: str = "auto",
                               decode_backend: str | None = None,
                               decode_backend_kwargs: dict[str, Any] | None = None,
                               deployment: DeploymentConfig | None = None,
                               **backend_kwargs: Any) -> str:
    """Register dbo backend ``backend`` (built with ``backend_kwargs``) under ``name`` in
    transformers' ``EPImplementationInterface``, running ``experts`` (:data:`EXPERTS_CHOICES`);
    returns ``name``. With ``decode_backend``, the calls made inside :func:`decode_phase` go
    through that backend instead (built with ``decode_backend_kwargs``; a backend sized by its
    tokens per call, such as ``deepep_ll``, takes :data:`DEEPEP_LL_MAX_TOKENS` by default).
    ``deployment``: the tuned deployment a model loaded with it runs
    (:func:`dbo.integrations.transformers.ep_model.expert_parallel_deployment`).

    Raises:
        ValueError: unknown backend, decode backend or experts choice.
        TransformersVersionError: transformers < :data:`MIN_TRANSFORMERS`.
    """
    backend_spec(backend)
    check_experts_choice(experts)
    decode_kwargs = checked_decode_kwargs(decode_backend, decode_backend_kwargs)
    if deployment is not None and not isinstance(deployment, DeploymentConfig):
        raise TypeError(f"deployment must be a DeploymentConfig, got {type(deployment).__name__}")
    interface = ep_interface()
    cls = type(f"DBOExpertParallel_{name}", (DBOExpertParallel,),
               {"backend": backend, "backend_kwargs": dict(backend_kwargs), "experts_choice": experts,
                "decode_backend": decode_backend, "decode_backend_kwargs": decode_kwargs,
                "deployment": deployment, "__module__": __name__})
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


def ep_distributed_config(backend: str = "all2all", world_size: int | None = None, *,
                          experts: str | None = None,
                          deployment: DeploymentConfig | str | os.PathLike | None = None) -> Any:
    """``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="dbo_<backend>")`` for
    ``from_pretrained``: every rank holds ``E / W`` whole experts and its own batch. The model it
    loads keeps its dense weights whole from its first forward on, which may run under
    ``torch.inference_mode()`` (:mod:`dbo.integrations.transformers.fsdp`).

    Args:
        backend: a backend name (``"deepep_ht"``), ``"deepep"`` (high-throughput kernels for
            the prefill, low-latency ones inside :func:`decode_phase`) or a registered
            implementation name.
        world_size: ``W`` (default: the default process group's size).
        experts: which experts run on what arrives: ``"auto"`` (dbo's library experts on the
            model's weights where its experts' layout allows, else the model's own),
            ``"library"`` (refused at load time where the layout does not allow) or ``"model"``
            (the experts module's own forward); None: the implementation's own (``"auto"`` for
            the ``dbo_<backend>`` names). Another choice than that is the implementation
            ``"dbo_<backend>:<experts>"``, registered by this call (on this rank).
        deployment: a tuned deployment (:class:`dbo.deployment.DeploymentConfig`, or the path of
            the file :func:`dbo.deployment.save_deployment_config` wrote, e.g. by ``python -m
            dbo.bench overlap --save-config``): the loaded model carries it
            (:func:`~dbo.integrations.transformers.ep_model.expert_parallel_deployment`) and
            :class:`DBOPrefill` runs it when given no config. The implementation is then
            ``"<name>@<digest of the config>"``, registered by this call (on this rank).

    Raises:
        TransformersVersionError: transformers < :data:`MIN_TRANSFORMERS`.
        FileNotFoundError, ValueError: a ``deployment`` file that is missing or is not one.
        ValueError: unknown backend or experts choice; no process group and no ``world_size``;
            a ``world_size`` other than the initialized process group's size; one rank
            (transformers loads a model whole at ``ep_size`` 1: convert it instead).
    """
    interface = ep_interface()
    from transformers.distributed import DistributedConfig

    if experts is not None:
        check_experts_choice(experts)
    name = backend if backend in EP_IMPLEMENTATIONS or backend.startswith("dbo_") else f"dbo_{backend}"
    registered = interface()
    if name not in EP_IMPLEMENTATIONS and name not in registered:
        raise ValueError(f"unknown backend {backend!r}; choose from "
                         f"{sorted({b for b, _ in EP_IMPLEMENTATIONS.values()} | {'deepep'})}")
    cls = registered.get(name)
    if isinstance(cls, type) and issubclass(cls, DBOExpertParallel):
        if experts is not None and cls.experts_choice != experts:
            base = name.partition(":")[0]
            base_cls = registered.get(base)
            name = base if getattr(base_cls, "experts_choice", None) == experts else f"{base}:{experts}"
            if name not in registered:
                register_ep_implementation(name, cls.backend, experts=experts,
                                           decode_backend=cls.decode_backend,
                                           decode_backend_kwargs=cls.decode_backend_kwargs,
                                           **cls.backend_kwargs)
    elif experts is not None:
        raise ValueError(f"{name!r} is not one of dbo's expert-parallel implementations: no experts "
                         "choice for it")
    if world_size is None:
        if not torch.distributed.is_initialized():
            raise ValueError("ep_distributed_config needs world_size or an initialized process group")
        world_size = torch.distributed.get_world_size()
    elif torch.distributed.is_initialized() and world_size != torch.distributed.get_world_size():
        raise ValueError(f"world_size={world_size}, but the process group has "
                         f"{torch.distributed.get_world_size()} ranks: dbo's expert parallelism runs "
                         "on every rank of it (leave world_size None)")
    if world_size < 2:
        raise ValueError("ep_distributed_config: one rank: transformers loads a model whole at ep_size 1 "
                         "and dbo's implementation would not run; load it without distributed_config and "
                         "call convert_to_expert_parallel(model, backend=...), which runs on any number "
                         "of ranks")
    if deployment is not None:
        name = _with_deployment(name, deployment, interface())
    return DistributedConfig(fsdp_size=world_size, ep_size=world_size, ep_implementation=name)


def _with_deployment(name: str, deployment: DeploymentConfig | str | os.PathLike,
                     registered: dict[str, Any]) -> str:
    """The implementation ``name`` carrying ``deployment`` (loaded if a path): registered as
    ``"<name>@<digest>"``, one name per distinct config."""
    if not isinstance(deployment, DeploymentConfig):
        deployment = load_deployment_config(deployment)
    text = json.dumps(dict(deployment.as_dict(), deployment={}), sort_keys=True)
    variant = f"{name}@{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    if variant not in registered:
        base = registered[name]
        register_ep_implementation(variant, base.backend, experts=base.experts_choice,
                                   decode_backend=base.decode_backend,
                                   decode_backend_kwargs=base.decode_backend_kwargs or None,
                                   deployment=deployment, **base.backend_kwargs)
    return variant


# importing this module (or dbo.integrations.transformers) registers the names; a no-op before 5.23
register_default_ep_implementations()
