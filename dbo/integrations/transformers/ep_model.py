"""A model loaded with dbo's expert-parallel implementations (:mod:`dbo.integrations.transformers.ep`):
find its dbo experts modules and their process group, and switch their backend (a prefill and a
decode one) or their experts on the loaded weights, without loading again.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.backends import backend_spec
from dbo.deployment import DeploymentConfig
from dbo.integrations.transformers.decode_phase import checked_decode_kwargs
from dbo.integrations.transformers.ep import DBOExpertParallel, check_experts_choice
from dbo.integrations.transformers.experts import LibraryExperts

__all__ = ["expert_parallel_modules", "expert_parallel_group", "expert_parallel_deployment",
           "switch_ep_backend", "switch_ep_experts", "ep_experts"]


def expert_parallel_modules(model: torch.nn.Module) -> list[tuple[str, DBOExpertParallel]]:
    """``(name, implementation)`` of every experts module of ``model`` that runs through one of
    dbo's implementations, in module order."""
    return [(name, m._dbo_expert_parallel) for name, m in model.named_modules()
            if isinstance(getattr(m, "_dbo_expert_parallel", None), DBOExpertParallel)]


def expert_parallel_group(model: torch.nn.Module) -> Any:
    """The expert-parallel process group of a model loaded with dbo's implementations, or None."""
    found = expert_parallel_modules(model)
    return found[0][1].group if found else None


def expert_parallel_deployment(model: torch.nn.Module) -> DeploymentConfig | None:
    """The tuned deployment a model was loaded for (``ep_distributed_config(...,
    deployment=...)``), or None."""
    found = expert_parallel_modules(model)
    return found[0][1].deployment if found else None


def _require_dbo_modules(model: torch.nn.Module) -> list[tuple[str, DBOExpertParallel]]:
    found = expert_parallel_modules(model)
    if not found:
        raise ValueError("the model has no experts module running through dbo's expert-parallel "
                         "implementations: load it with ep_distributed_config(...)")
    return found


def switch_ep_backend(model: torch.nn.Module, backend: str, *, decode_backend: str | None = None,
                      decode_backend_kwargs: dict[str, Any] | None = None,
                      **backend_kwargs: Any) -> torch.nn.Module:
    """Run every experts module that goes through dbo's implementations through ``backend``
    (built with ``backend_kwargs`` at its next call) from now on, and the calls made inside
    :func:`~dbo.integrations.transformers.decode_phase.decode_phase` through ``decode_backend``
    (None: ``backend`` there too); returns ``model``. For comparing backends on one loaded model (the loaded
    weights stay where they are), or for pairing a prefill backend with a decode one
    (``switch_ep_backend(model, "deepep_ht", decode_backend="deepep_ll")``).

    Raises:
        ValueError: unknown backend or decode backend, or no experts module runs through dbo's
            implementations.
    """
    backend_spec(backend)
    checked_decode_kwargs(decode_backend, decode_backend_kwargs)
    for _, impl in _require_dbo_modules(model):
        impl.switch_backend(backend, decode_backend=decode_backend,
                            decode_backend_kwargs=decode_backend_kwargs, **backend_kwargs)
    return model


def switch_ep_experts(model: torch.nn.Module, experts: str) -> torch.nn.Module:
    """Run ``experts`` (:data:`EXPERTS_CHOICES`) in every experts module that goes through dbo's
    implementations from its next call on, on the same backend and weights; returns ``model``.
    All modules are checked before any changes.

    Raises:
        ValueError: unknown choice, or no experts module runs through dbo's implementations.
        UnsupportedEPError: ``"library"`` for a model whose experts the library experts cannot run.
    """
    check_experts_choice(experts)
    found = _require_dbo_modules(model)
    if experts == "library":
        for _, impl in found:
            LibraryExperts(impl._module)  # raises for a layout it cannot run
    for _, impl in found:
        impl.set_experts(experts)
    return model


def ep_experts(model: torch.nn.Module) -> dict[str, str]:
    """Experts module name -> the experts it runs (``"library"`` or ``"model"``), for every
    experts module of ``model`` that goes through dbo's implementations."""
    return {name: impl.experts_kind for name, impl in expert_parallel_modules(model)}
