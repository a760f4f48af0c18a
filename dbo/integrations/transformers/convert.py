"""Expert parallelism and DBO for Hugging Face transformers MoE models.

:func:`convert_to_expert_parallel` turns a loaded transformers MoE model (Qwen3-MoE, Mixtral,
DeepSeek-V3) into an expert-parallel one on a process group: each sparse MoE block becomes an
:class:`~dbo.integrations.transformers.moe_block.ExpertParallelMoE` that keeps the block's own router and
shared experts and holds only this rank's contiguous slice of the routed experts (the rest are
freed), behind an all-to-all backend chosen by name. Attention, norms and embeddings stay
replicated (data-parallel attention): every rank runs its own batch of sequences.

With transformers >= 5.23 a checkpoint can instead be loaded expert-parallel by transformers
itself, with dbo's backends as its EP implementations (:mod:`dbo.integrations.transformers.ep`, registered
when this module is imported); :class:`DBOPrefill` and ``greedy_generate`` run either model.

:class:`DBOPrefill` runs the converted model's prefill as overlapped ubatches
(:class:`dbo.DBOWrapper`): ``input_ids [batch, seq]`` is split at sequence boundaries, each
ubatch runs the whole model, the logits are merged in order.

Needs transformers >= 5.17 (the MoE blocks with fused 3-D expert weights ``gate_up_proj``
``[E, 2I, hidden]`` / ``down_proj`` ``[E, hidden, I]`` and a router module returning
``(logits, topk_weights, topk_ids)``). Install with ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from dbo.autotune import AutotuneResult, autotune_split_config
from dbo.backends import backend_spec, make_backend
from dbo.errors import DBOError
from dbo.integrations.transformers.ep import prepare_for_overlap
from dbo.integrations.transformers.ep_model import expert_parallel_group
from dbo.integrations.transformers.faults import named_device_faults
from dbo.integrations.transformers.moe_block import ExpertParallelMoE, routing_token_mask
from dbo.overlap import DBOWrapper
from dbo.split import SplitConfig, UBatchPlan

__all__ = [
    "MoEFamily",
    "FAMILIES",
    "UnsupportedModelError",
    "find_moe_blocks",
    "convert_to_expert_parallel",
    "set_backend",
    "prefill_split_config",
    "prefill_logits",
    "DBOPrefill",
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


def _group_rank_size(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("convert_to_expert_parallel needs an initialized torch.distributed "
                           "process group (a group of one is fine)")
    return dist.get_rank(group), dist.get_world_size(group)


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
    device stays there: materialise it after conversion, see :mod:`dbo.bench.hf_model`).

    Args:
        model: a transformers MoE model (``...ForCausalLM`` or its base model) whose MoE blocks
            are in :data:`FAMILIES`.
        group: the expert-parallel process group (None: the default group).
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
        ValueError: the expert count is not a multiple of the group size; unknown backend.
        RuntimeError: torch.distributed is not initialised.
    """
    backend_spec(backend)
    blocks = find_moe_blocks(model)
    rank, world = _group_rank_size(group)
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
        pf = make_backend(backend, group, hidden=hidden, num_experts=num_experts, topk=topk,
                          dtype=gate_up.dtype, device=gate_up.device,
                          max_tokens_per_rank=max_tokens_per_rank, **backend_kwargs)
        shared = getattr(block, family.shared_attr) if family.shared_attr else None
        new = ExpertParallelMoE(router, w1, w2, pf, num_experts=num_experts, first_expert=lo,
                                topk=topk, shared_experts=shared, family=family.name)
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
        block.use_backend(make_backend(backend, group, hidden=block.w1.shape[2],
                                       num_experts=block.num_experts, topk=block.topk,
                                       dtype=block.w1.dtype, device=block.w1.device,
                                       max_tokens_per_rank=max_tokens_per_rank, **backend_kwargs))
    return model


def prefill_split_config(min_sequences: int = 2, **kwargs: Any) -> SplitConfig:
    """A :class:`SplitConfig` for :class:`DBOPrefill`, whose rows are sequences, not tokens:
    split from ``min_sequences`` sequences per rank on (other fields as ``SplitConfig``)."""
    kwargs.setdefault("prefill_token_threshold", min_sequences)
    kwargs.setdefault("decode_token_threshold", min_sequences)
    return SplitConfig(**kwargs)


def prefill_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0,
                   mask_padding_tokens: bool = True) -> torch.Tensor:
    """One plain (not overlapped) prefill forward of a causal LM, without a KV cache.

    Args:
        input_ids: ``[batch, seq]`` int64.
        attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding (None: all real).
        logits_to_keep: 0 for every position, k for the last k (the model's own argument).
        mask_padding_tokens: route tokens with attention mask 0 to no expert (their logits
            are meaningless either way).

    Returns:
        ``[batch, seq or logits_to_keep, vocab]`` logits in the model's dtype.
    """
    kwargs: dict[str, Any] = {"use_cache": False}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    with routing_token_mask(attention_mask if mask_padding_tokens else None):
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


class DBOPrefill(torch.nn.Module):
    """Overlapped prefill of a (converted, or loaded with dbo's expert-parallel implementations)
    transformers causal LM. A model loaded with FSDP2 is first
    :func:`~dbo.integrations.transformers.fsdp.prepare_for_overlap`'d (collective: build it on every rank; a
    no-op once the model has run a forward).

    ``DBOPrefill(model, group=ep_group)(input_ids, attention_mask)`` splits the batch at
    sequence boundaries into ubatches (all ranks of ``group`` agree, padding with all-padding
    sequences where a rank has fewer), runs :func:`prefill_logits` on each, overlapped, and
    returns the logits in order. A rank with nothing to do still calls it (the MoE layers are
    collective), with one all-padding sequence.

    Args:
        model: the model (converted with :func:`convert_to_expert_parallel`).
        config: the split; default :func:`prefill_split_config` (split from 2 sequences).
        group: the expert-parallel group (agrees on the split; default: the group of a model
            loaded with dbo's expert-parallel implementations, else the default group).
        logits_to_keep, mask_padding_tokens: as in :func:`prefill_logits`.
        sm_carveout, trace, timeout_s: as in :class:`dbo.DBOWrapper` (``timeout_s`` bounds
            every wait for a peer rank in the model's backends during the call).
        sync_faults: where a backend waits for its peers inside GPU kernels that trap after the
            timeout (copy_engine on CUDA), wait for the GPU at the end of each call, so that a
            peer that died or stalled late in the call shows here as the named
            :class:`~dbo.errors.CollectiveTimeoutError` and not at your next CUDA call as a bare
            "unspecified launch failure" (default True; False returns before the GPU is done,
            as a plain forward does).
    """

    def __init__(self, model: torch.nn.Module, config: SplitConfig | None = None, *, group: Any = None,
                 logits_to_keep: int = 0, mask_padding_tokens: bool = True,
                 sm_carveout: int | None = None, trace: Any = None, timeout_s: float | None = None,
                 sync_faults: bool = True):
        super().__init__()
        self.model = prepare_for_overlap(model)
        if group is None:
            group = expert_parallel_group(model)
        self.logits_to_keep = logits_to_keep
        self.mask_padding_tokens = mask_padding_tokens
        self.sync_faults = bool(sync_faults)
        self.wrapper = DBOWrapper(self._forward, prefill_split_config() if config is None else config,
                                  group=group, sm_carveout=sm_carveout, trace=trace,
                                  timeout_s=timeout_s)
        #: device memory per token (of ``input_ids``) that the plain prefill needs, with the
        #: autotune's margin; 0: unknown. Where set (:meth:`autotune` sets it on CUDA), a call for
        #: which a rank has less free raises DeviceMemoryError on every rank before it starts
        self.plain_bytes_per_token = 0

    @property
    def last_plan(self) -> UBatchPlan | None:
        """The plan of the latest call (rows are sequences)."""
        return self.wrapper.last_plan

    def autotune(self, seq_len: int, batch_sizes: Sequence[int], *, vocab_size: int | None = None,
                 warmup: int = 1, steps: int = 3, rounds: int = 1, margin: float = 0.02,
                 schedules: Sequence[str] = ("split", "merged", "sbo"),
                 sm_carveouts: Sequence[int | None] | None = None) -> AutotuneResult:
        """Time the prefill plainly and overlapped at ``batch_sizes`` sequences of ``seq_len``
        random tokens per rank, and keep the winner: from then on this prefill splits from the
        smallest batch at which DBO won by ``margin`` (with the faster expert schedule), never
        (it runs plainly where DBO did not pay), or never with ``sbo`` where that won at every
        batch size. Collective: every rank calls it with the same
        arguments (:func:`dbo.autotune.autotune_split_config`).

        The choice is a sequence count, for this ``seq_len``: tune one prefill per prompt length
        that matters (a token count sets the cost, and rows here are sequences).

        ``sm_carveouts`` (e.g. ``(None, 16)``) measures the overlapped runs with each SM
        carve-out and keeps the one that pays (as the prefill's ``sm_carveout`` from then on);
        None times them with the prefill's own ``sm_carveout``. The plain call's device memory
        it measures (``AutotuneResult.plain_bytes_per_row``, CUDA only) sets
        :attr:`plain_bytes_per_token`.

        Returns:
            the :class:`~dbo.autotune.AutotuneResult` (its rows are by sequences per rank).

        Raises:
            ValueError: ``seq_len < 1`` or a bad ``batch_sizes`` (and as
                :func:`~dbo.autotune.autotune_split_config`).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        vocab = vocab_size or int(self.model.config.vocab_size)
        device = next(self.model.parameters()).device
        g = torch.Generator().manual_seed(seq_len)

        def make_inputs(batch: int) -> list[torch.Tensor]:
            return [torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)]

        result = autotune_split_config(self._forward, make_inputs, batch_sizes, decode_only=False,
                                       config=self.wrapper.config, group=self.wrapper.group,
                                       warmup=warmup, steps=steps, rounds=rounds, margin=margin,
                                       sm_carveout=self.wrapper.sm_carveout, schedules=schedules,
                                       sm_carveouts=sm_carveouts)
        self.wrapper.config = result.config
        self.wrapper.sm_carveout = result.sm_carveout
        self.plain_bytes_per_token = -(-result.plain_bytes_per_row // seq_len)  # rows: sequences
        return result

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return prefill_logits(self.model, input_ids, attention_mask, logits_to_keep=self.logits_to_keep,
                              mask_padding_tokens=self.mask_padding_tokens)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                plan: UBatchPlan | None = None) -> torch.Tensor:
        """``input_ids`` ``[batch, seq]`` (and ``attention_mask`` of the same shape) -> logits
        ``[batch, seq or logits_to_keep, vocab]``, the same as :func:`prefill_logits`."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] == 0:
            raise ValueError("an empty batch cannot run the model: give a rank with nothing to do "
                             "one all-padding sequence (attention_mask all 0)")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        need = self.plain_bytes_per_token * input_ids.numel() or None
        with named_device_faults(sync=self.sync_faults):
            masks = () if attention_mask is None else (attention_mask,)
            return self.wrapper(input_ids, *masks, plan=plan, need_bytes=need)

