"""Expert parallelism and DBO for Hugging Face transformers MoE models.

:func:`convert_to_expert_parallel` turns a loaded transformers MoE model (Qwen3-MoE, Mixtral,
DeepSeek-V3) into an expert-parallel one on a process group: each sparse MoE block becomes an
:class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` that keeps the block's own router and
shared experts and holds only this rank's contiguous slice of the routed experts (the rest are
freed), behind an all-to-all backend chosen by name. Attention, norms and embeddings stay
replicated (data-parallel attention): every rank runs its own batch of sequences.

With transformers >= 5.23 a checkpoint can instead be loaded expert-parallel by transformers
itself, with dbo's backends as its EP implementations (:mod:`dbo.integrations.transformers.ep`, registered
when this package is imported); :class:`~dbo.integrations.transformers.prefill.DBOPrefill` and
``greedy_generate`` run either model.

Needs transformers >= 5.17 (the MoE blocks with fused 3-D expert weights ``gate_up_proj``
``[E, 2I, hidden]`` / ``down_proj`` ``[E, hidden, I]`` and a router module returning
``(logits, topk_weights, topk_ids)``). Install with ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from dbo.backends import backend_spec, make_backend
from dbo.errors import DBOError
from dbo.integrations.transformers.emulated import backend_group_options, ep_rank_size
from dbo.integrations.transformers.moe_block import ExpertParallelMoE

__all__ = [
    "MoEFamily",
    "FAMILIES",
    "UnsupportedModelError",
    "find_moe_blocks",
    "convert_to_expert_parallel",
    "set_backend",
]

logger = logging.getLogger(__name__)

_SILU = ("silu", "swish")


@dataclass(frozen=True)
class MoEFamily:
    """Where a family's MoE block keeps its parts.

    Attributes:
        name: the family (for messages).
        block_class: the class name of its sparse MoE block.
        router_attr, experts_attr: attributes of the block holding the router module and the
            fused experts module (``gate_up_proj`` ``[E, 2I, hidden]``, ``down_proj``
            ``[E, hidden, I]``, ``act_fn``).
        shared_attr: attribute holding the shared experts module, or None.
    """

    name: str
    block_class: str
    router_attr: str = "gate"
    experts_attr: str = "experts"
    shared_attr: str | None = None


FAMILIES: Mapping[str, MoEFamily] = MappingProxyType({f.block_class: f for f in (
    MoEFamily("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    MoEFamily("mixtral", "MixtralSparseMoeBlock"),
    MoEFamily("deepseek_v3", "DeepseekV3MoE", shared_attr="shared_experts"),
)})


class UnsupportedModelError(DBOError, TypeError):
    """The model has no MoE block this integration knows, or one it cannot convert."""


def _looks_like_moe(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return ("moe" in name and "block" in name) or name.endswith("moe") or (
        hasattr(module, "experts") and hasattr(module, "gate"))


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, MoEFamily]]:
    """The supported sparse MoE blocks of ``model``: ``(qualified name, block, family)``.

    Raises:
        UnsupportedModelError: a module that looks like an MoE block (its class name says so,
            or it has ``experts`` and ``gate``) is of no supported class, or there is no MoE
            block at all.
    """
    found = []
    for name, module in model.named_modules():
        family = FAMILIES.get(type(module).__name__)
        if family is not None:
            found.append((name, module, family))
        elif isinstance(module, ExpertParallelMoE):
            raise UnsupportedModelError(f"{name} is already converted (ExpertParallelMoE)")
        elif name and _looks_like_moe(module) and not any(name.startswith(f + ".") for f, _, _ in found):
            raise UnsupportedModelError(
                f"{type(model).__name__}: MoE block {name} is a {type(module).__name__}, which dbo "
                f"cannot convert; supported MoE blocks: {', '.join(sorted(FAMILIES))}")
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no sparse MoE block dbo can convert; supported MoE blocks: "
            f"{', '.join(sorted(FAMILIES))}")
    return found


def _expert_weights(name: str, block: torch.nn.Module,
                    family: MoEFamily) -> tuple[torch.Tensor, torch.Tensor]:
    experts = getattr(block, family.experts_attr)
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) \
            or gate_up.dim() != 3 or down.dim() != 3:
        raise UnsupportedModelError(
            f"{name}: {type(experts).__name__} has no fused 3-D gate_up_proj/down_proj (transformers "
            f"< 5.17 keeps experts as a ModuleList; dbo needs transformers >= 5.17)")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise UnsupportedModelError(f"{name}: experts with biases are not supported")
    return gate_up, down


def _check_activation(name: str, config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in _SILU:
        raise UnsupportedModelError(f"{name}: expert activation {act!r}; dbo's experts are SwiGLU "
                                    f"(silu) only")


def convert_to_expert_parallel(model: torch.nn.Module, group: Any = None, backend: str = "all2all", *,
                               max_tokens_per_rank: int | None = None,
                               **backend_kwargs: Any) -> torch.nn.Module:
    """Make ``model`` expert-parallel over ``group``, in place; returns ``model``.

    Every rank of ``group`` calls this on the same model (same config and weights: experts are
    sliced from the model's own). Rank ``r`` of ``W`` keeps experts ``[r * E / W, (r + 1) * E / W)``
    of every MoE layer; the other experts' weights are released (a model built on the meta
    device stays there: materialise it after conversion, see :mod:`dbo.bench.hf.model`).

    Args:
        model: a transformers MoE model (``...ForCausalLM`` or its base model) whose MoE blocks
            are in :data:`FAMILIES`.
        group: the expert-parallel process group (None: the default group), or an
            :class:`~dbo.backends.emulated.EmulatedGroup`: this process plays rank ``r`` of ``N``
            alone, with the ``emulated`` backend and no process group
            (:mod:`~dbo.integrations.transformers.emulated`).
        backend: a name in :data:`dbo.backends.BACKENDS`.
        max_tokens_per_rank: most tokens a rank sends through one MoE call (one ubatch's
            ``batch * seq``); needed by the low-latency backends.
        backend_kwargs: passed to the backend's constructor; ``timeout_s=`` (every backend
            takes it) bounds each wait for a peer rank.

    Returns:
        ``model``, with each MoE block replaced by an
        :class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE`.

    Raises:
        UnsupportedModelError: the model's MoE blocks are of an unsupported class (the message
            names it and the supported ones) or use non-SwiGLU experts.
        ValueError: the expert count is not a multiple of the group size; unknown backend; the
            emulated backend without an EmulatedGroup, or an EmulatedGroup with another backend.
        RuntimeError: torch.distributed is not initialised (and ``group`` is no EmulatedGroup).
    """
    backend_spec(backend)
    blocks = find_moe_blocks(model)
    backend_group, backend_kwargs = backend_group_options(backend, group, backend_kwargs)
    rank, world = ep_rank_size(group)
    config = getattr(model, "config", None)
    for name, block, family in blocks:
        gate_up, down = _expert_weights(name, block, family)
        _check_activation(name, config)
        router = getattr(block, family.router_attr)
        num_experts, two_i, hidden = gate_up.shape
        if num_experts % world:
            raise ValueError(f"{name}: {num_experts} experts cannot be split evenly over {world} ranks")
        local = num_experts // world
        lo = rank * local
        # clone: the slice must not keep the whole expert tensor alive
        w1 = gate_up.detach()[lo:lo + local].clone()
        w2 = down.detach()[lo:lo + local].clone()
        topk = int(getattr(router, "top_k", 0) or getattr(block, "top_k", 0))
        if topk <= 0:
            raise UnsupportedModelError(f"{name}: cannot find the router's top_k")
        pf = make_backend(backend, backend_group, hidden=hidden, num_experts=num_experts, topk=topk,
                          dtype=gate_up.dtype, device=gate_up.device,
                          max_tokens_per_rank=max_tokens_per_rank, **backend_kwargs)
        shared = getattr(block, family.shared_attr) if family.shared_attr else None
        new = ExpertParallelMoE(router, w1, w2, pf, num_experts=num_experts, first_expert=lo,
                                topk=topk, shared_experts=shared, family=family.name, group=group)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        del block, gate_up, down
    logger.info("dbo: converted %d MoE blocks to expert parallel (rank %d of %d, backend %s)",
                len(blocks), rank, world, backend)
    return model


def set_backend(model: torch.nn.Module, backend: str, group: Any = None, *,
                max_tokens_per_rank: int | None = None, **backend_kwargs: Any) -> torch.nn.Module:
    """Switch every converted MoE block of ``model`` to a new backend ``backend`` on ``group``
    (collective for the DeepEP backends); returns ``model``. Arguments as in
    :func:`convert_to_expert_parallel`. Call it after materialising a model converted on the
    meta device, or to compare backends on one model.

    Raises:
        ValueError: unknown backend (checked first); ``model`` has no converted block.
    """
    backend_spec(backend)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    if not blocks:
        raise ValueError("the model has no converted MoE block: call convert_to_expert_parallel first")
    for block in blocks:
        block.switch_backend(backend, group=group, max_tokens_per_rank=max_tokens_per_rank, **backend_kwargs)
    return model
