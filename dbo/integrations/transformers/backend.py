"""Choose the backend of an expert-parallel transformers model, whichever way it was made so.

A model is expert-parallel with dbo in one of two ways: converted in memory
(:func:`~dbo.integrations.transformers.convert.convert_to_expert_parallel`, its MoE blocks become
:class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE`), or loaded with
``from_pretrained(..., distributed_config=ep_distributed_config(...))`` (its experts modules run
through :class:`~dbo.integrations.transformers.ep.DBOExpertParallel`). :func:`use_backend` moves
its tokens through another backend in either case; the two functions it routes to
(:func:`~dbo.integrations.transformers.convert.set_backend`,
:func:`~dbo.integrations.transformers.ep_model.switch_ep_backend`) stay public for callers that
know which kind of model they hold.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.backends import backend_spec
from dbo.integrations.transformers.convert import set_backend
from dbo.integrations.transformers.ep_model import expert_parallel_modules, switch_ep_backend
from dbo.integrations.transformers.moe_block import ExpertParallelMoE

__all__ = ["use_backend", "expert_parallel_kind"]


def expert_parallel_kind(model: torch.nn.Module) -> str | None:
    """How ``model`` was made expert-parallel: ``"converted"`` (it has
    :class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` blocks), ``"loaded"``
    (experts modules running through dbo's EP implementations) or None (neither)."""
    if any(isinstance(m, ExpertParallelMoE) for m in model.modules()):
        return "converted"
    if expert_parallel_modules(model):
        return "loaded"
    return None


def use_backend(model: torch.nn.Module, name: str, *, group: Any = None,
                decode_backend: str | None = None, decode_backend_kwargs: dict[str, Any] | None = None,
                **options: Any) -> torch.nn.Module:
    """Move ``model``'s expert-parallel tokens through backend ``name`` from its next forward on;
    returns ``model``. Collective where the backend is (copy_engine, DeepEP): every rank calls it.

    Args:
        model: a converted model or one loaded with dbo's EP implementations.
        name: a key of :data:`dbo.backends.BACKENDS`; checked once, before anything changes.
        group: a converted model's expert-parallel group (None: the default group); a loaded
            model keeps the group it was loaded on, so leave it None there.
        decode_backend, decode_backend_kwargs: a loaded model only: the backend (and its
            options) of the calls made inside
            :func:`~dbo.integrations.transformers.ep.decode_phase`, as
            :func:`~dbo.integrations.transformers.ep_model.switch_ep_backend` takes them.
        options: the backend's options (``max_tokens_per_rank=``, ``link=``, ``timeout_s=``, ...),
            as :func:`dbo.backends.make_backend` takes them.

    Raises:
        ValueError: unknown ``name`` or ``decode_backend`` (the message lists the known ones); a
            model that is not expert-parallel with dbo; ``decode_backend`` for a converted model
            or ``group`` for a loaded one.
    """
    backend_spec(name)
    kind = expert_parallel_kind(model)
    if kind == "converted":
        if decode_backend is not None or decode_backend_kwargs:
            raise ValueError(f"decode_backend={decode_backend!r}: a converted model runs one backend; "
                             "a prefill/decode pair needs a model loaded with ep_distributed_config(...)")
        return set_backend(model, name, group, **options)
    if kind == "loaded":
        if group is not None:
            raise ValueError("group: a model loaded with ep_distributed_config(...) keeps the group it "
                             "was loaded on; leave group=None")
        return switch_ep_backend(model, name, decode_backend=decode_backend,
                                 decode_backend_kwargs=decode_backend_kwargs, **options)
    raise ValueError(f"{type(model).__name__} is not expert-parallel with dbo: convert it with "
                     "convert_to_expert_parallel(model, ...) or load it with from_pretrained(..., "
                     "distributed_config=ep_distributed_config(...))")
