"""Choose the backend of an expert-parallel transformers model, whichever way it was made so.

A model is expert-parallel with dbo in one of two ways: converted in memory
(:func:`~dbo.integrations.transformers.convert.convert_to_expert_parallel`, its MoE blocks become
:class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE`), or loaded with
``from_pretrained(..., distributed_config=ep_distributed_config(...))`` (its experts modules run
through :class:`~dbo.integrations.transformers.ep.DBOExpertParallel`). Both kinds of layer have
one method, ``switch_backend``, and :func:`use_backend` is a loop over a model's layers that
calls it (:func:`expert_parallel_layers` finds them). The per-kind loops
(:func:`~dbo.integrations.transformers.convert.set_backend`,
:func:`~dbo.integrations.transformers.ep_model.switch_ep_backend`) stay public.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.backends import backend_spec
from dbo.integrations.transformers.ep import DBOExpertParallel
from dbo.integrations.transformers.moe_block import ExpertParallelMoE

__all__ = ["use_backend", "expert_parallel_kind", "expert_parallel_layers"]


def expert_parallel_layers(model: torch.nn.Module) -> list[Any]:
    """The expert-parallel layers of ``model`` in module order, whichever way it was made so:
    its :class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` blocks, or the
    :class:`~dbo.integrations.transformers.ep.DBOExpertParallel` implementations of its
    experts modules. Each has ``switch_backend(name, *, group, decode_backend,
    decode_backend_kwargs, **options)``."""
    layers: list[Any] = []
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            layers.append(m)
        elif isinstance(getattr(m, "_dbo_expert_parallel", None), DBOExpertParallel):
            layers.append(m._dbo_expert_parallel)
    return layers


def expert_parallel_kind(model: torch.nn.Module) -> str | None:
    """How ``model`` was made expert-parallel: ``"converted"`` (it has
    :class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` blocks), ``"loaded"``
    (experts modules running through dbo's EP implementations) or None (neither)."""
    layers = expert_parallel_layers(model)
    if not layers:
        return None
    return "converted" if isinstance(layers[0], ExpertParallelMoE) else "loaded"


def use_backend(model: torch.nn.Module, name: str, *, group: Any = None,
                decode_backend: str | None = None, decode_backend_kwargs: dict[str, Any] | None = None,
                **options: Any) -> torch.nn.Module:
    """Move ``model``'s expert-parallel tokens through backend ``name`` from its next forward on;
    returns ``model``. Collective where the backend is (copy_engine, DeepEP): every rank calls it.

    Args:
        model: a converted model or one loaded with dbo's EP implementations.
        name: a key of :data:`dbo.backends.BACKENDS`; checked once, before anything changes.
        group: a converted model's expert-parallel group (None: the group it was converted over,
            a process group or an :class:`~dbo.backends.emulated.EmulatedGroup`); a loaded model
            keeps the group it was loaded on, so leave it None there.
        decode_backend, decode_backend_kwargs: the backend (and its options) of the calls made
            inside :func:`~dbo.integrations.transformers.decode_phase.decode_phase` (DeepEP's
            low-latency kernels after a high-throughput prefill; None: ``name`` there too), as
            :func:`~dbo.integrations.transformers.ep_model.switch_ep_backend` takes them.
        options: the backend's options (``max_tokens_per_rank=``, ``link=``, ``timeout_s=``, ...),
            as :func:`dbo.backends.make_backend` takes them.

    Raises:
        ValueError: unknown ``name`` or ``decode_backend`` (the message lists the known ones); a
            model that is not expert-parallel with dbo; ``group`` for a loaded one; a backend that
            cannot run over a converted model's group (the emulated one over a process group, or
            another over an emulated group).
    """
    backend_spec(name)
    layers = expert_parallel_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} is not expert-parallel with dbo: convert it with "
                         "convert_to_expert_parallel(model, ...) or load it with from_pretrained(..., "
                         "distributed_config=ep_distributed_config(...))")
    # the layers of a model are of one kind: the first refuses arguments its kind does not take
    # before any layer changes
    for layer in layers:
        layer.switch_backend(name, group=group, decode_backend=decode_backend,
                             decode_backend_kwargs=decode_backend_kwargs, **options)
    return model
