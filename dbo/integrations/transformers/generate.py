"""Greedy generation with a KV cache, the prefill (and, on request, every decode step) as
overlapped ubatches.

The split is decided once, at the prefill (one vote over the group). Each ubatch's prefill makes
its own KV cache (a transformers ``Cache`` per ubatch). Then, by default, the ubatches' caches
are joined into one (their rows in batch order, padding rows dropped) and the decode steps run
plainly over the whole batch: on one host a decode step is too short for DBO to pay (its eager
step is host-bound, and comm is 14-19% of a decode layer), while the prefill gains. With
``split_decode=True`` every decode step is overlapped too: ubatch ``i`` keeps the same sequences
(plus the same padding rows) and its own cache, for links where a decode step's comm is a large
share (docs/multihost.md). Caches that cannot be joined (anything but transformers'
``DynamicCache`` of key/value layers) keep the split for the decode steps. Every rank of the
group runs the same number of steps (the MoE layers are collective), so ``max_new_tokens`` must
be the same everywhere and there is no early stop.

The decode steps (every step after the prefill) run inside
:func:`~dbo.integrations.transformers.decode_phase.decode_phase`: a model whose experts have a decode backend
(``switch_ep_backend(model, "deepep_ht", decode_backend="deepep_ll")``, or the ``dbo_deepep``
implementation) moves the prompt through the first and each new token through the second.

Why not ``model.generate``: it drives one cache for the whole batch, and transformers 5.x has
no public way to split a cache by batch rows or join ubatch caches back (``batch_split`` /
``from_batch_splits`` are gone), which a per-step split decision would need whenever it changes.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import torch

from dbo.integrations.transformers.decode_phase import decode_phase
from dbo.integrations.transformers.ep import prepare_for_overlap
from dbo.integrations.transformers.ep_model import expert_parallel_group
from dbo.integrations.transformers.faults import named_device_faults
from dbo.integrations.transformers.graph_decode import static_cache_from, static_decode
from dbo.integrations.transformers.moe_block import routing_token_mask
from dbo.overlap import current_ubatch, overlapped_forward
from dbo.split import SplitConfig, UBatchPlan, no_split_plan, plan_ubatches
from dbo.ubatch.sm import check_sm_carveout

__all__ = ["greedy_generate", "join_caches", "mask_positions", "cache_keyword"]

logger = logging.getLogger(__name__)

# the cache layers whose state is one key and one value tensor, batch first
_JOINABLE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def join_caches(caches: list[Any], rows: list[int]) -> Any | None:
    """One transformers cache of the rows ``caches[i][:rows[i]]``, in order (the ubatches'
    sequences in batch order, each ubatch's padding rows dropped), or None where the caches
    cannot be joined (not a ``DynamicCache`` of key/value layers, or layers that differ in
    anything but the batch). The rows are copied once: while it runs, the KV cache is held
    twice."""
    from transformers.cache_utils import DynamicCache

    first = caches[0]
    if any(type(c) is not DynamicCache for c in caches):
        return None
    layers = [getattr(c, "layers", None) for c in caches]
    if any(ls is None or len(ls) != len(layers[0]) for ls in layers):
        return None
    joined_layers = []
    for per_ubatch in zip(*layers, strict=True):
        head = per_ubatch[0]
        if type(head).__name__ not in _JOINABLE_LAYERS or any(type(x) is not type(head) for x in per_ubatch):
            return None
        keys = [getattr(x, "keys", None) for x in per_ubatch]
        values = [getattr(x, "values", None) for x in per_ubatch]
        if any(not isinstance(t, torch.Tensor) or t.dim() < 2 for t in keys + values):
            return None
        if any(k.shape[1:] != keys[0].shape[1:] or v.shape[1:] != values[0].shape[1:]
               for k, v in zip(keys, values, strict=True)):
            return None
        layer = copy.copy(head)
        layer.keys = torch.cat([k[:n] for k, n in zip(keys, rows, strict=True)])
        layer.values = torch.cat([v[:n] for v, n in zip(values, rows, strict=True)])
        joined_layers.append(layer)
    joined = copy.copy(first)
    joined.layers = joined_layers
    return joined


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes the KV cache and its output returns it:
    ``cache`` from transformers 5.24 on (where ``past_key_values`` is deprecated, to be removed in
    5.40), ``past_key_values`` before. Read from the forward's signature (through its decorators);
    a forward that names neither (a wrapper's ``**kwargs``) gets ``past_key_values``, which every
    transformers 5.x before 5.40 accepts."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """The tokens' positions under a ``[batch, seq]`` attention mask, as transformers'
    ``generate()`` counts them: left padding does not shift the real tokens' positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def greedy_generate(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
                    config: SplitConfig | None = None, group: Any = None,
                    mask_padding_tokens: bool = True,
                    split_decode: bool = False,
                    cuda_graph: bool = False,
                    sm_carveout: int | None = None) -> tuple[torch.Tensor, UBatchPlan]:
    """Greedy decoding of ``max_new_tokens`` tokens, the prefill overlapped when the group
    splits (and the decode steps too with ``split_decode``).

    Args:
        model: a (converted) transformers causal LM.
        input_ids: ``[batch, seq]`` int64 prompts, left-padded.
        attention_mask: ``[batch, seq]`` 1 real, 0 padding (None: all real).
        max_new_tokens: decode steps (>= 1), the same on every rank of ``group``.
        config: the split (rows are sequences; default: split from 2 sequences).
        group: the expert-parallel group (agrees on the split once, at the prefill; default: the
            group of a model loaded with dbo's expert-parallel implementations, else the default
            group). A model loaded with FSDP2 is first
            :func:`~dbo.integrations.transformers.fsdp.prepare_for_overlap`'d
            (a no-op once it has run a forward).
        mask_padding_tokens: route prompt padding to no expert.
        split_decode: overlap every decode step as the prefill (each ubatch keeping its own
            cache); False (the default): join the ubatches' caches after the prefill and decode
            plainly over the whole batch. The same on every rank of ``group``.
        cuda_graph: decode from a static KV cache, the steps after the first replayed from one
            CUDA graph captured in this call (:mod:`~dbo.integrations.transformers.graph_decode`;
            the backend must be capturable: ``deepep_ll``, ``copy_engine``; on the CPU the same
            steps run eagerly). With ``split_decode`` each ubatch decodes from a static cache
            of its own and the captured step is the overlapped one. Where a cache cannot be made
            static (not a ``DynamicCache`` of full-attention layers) the steps run eagerly, said
            once in the log. The same on every rank of ``group``.
        sm_carveout: SMs the matmuls leave free while the ubatches of an overlapped step run
            (the prefill, and the decode steps with ``split_decode``), as
            :func:`~dbo.overlap.overlapped_forward`'s: room for the communication kernels beside
            the experts' persistent grids. None (default): every SM. A plain step runs without it.

    Returns:
        ``(tokens [batch, seq + max_new_tokens] int64, plan)``: the prompts followed by the
        generated tokens, and the prefill's split (the decode steps' too with
        ``split_decode``).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sm_carveout(sm_carveout)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if config is None:
        config = SplitConfig(prefill_token_threshold=2, decode_token_threshold=2)
    prepare_for_overlap(model)
    if group is None:
        group = expert_parallel_group(model)
    plan = plan_ubatches(input_ids.shape[0], config, group=group)
    caches: dict[int, Any] = {}
    cache_kw = cache_keyword(model)  # once: "cache" on transformers >= 5.24

    def step(ids: torch.Tensor, full_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        info = current_ubatch()
        index = 0 if info is None else info.index
        routing = full_mask[:, -ids.shape[1]:] if mask_padding_tokens else None
        with routing_token_mask(routing):
            out = model(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1, **{cache_kw: caches.get(index)})
        caches[index] = getattr(out, cache_kw)
        return out.logits[:, -1]

    def graph_steps(ids: torch.Tensor, positions: torch.Tensor, full_mask: torch.Tensor,
                    steps: int, step_plan: UBatchPlan) -> torch.Tensor | None:
        """The decode steps from static caches (``cuda_graph``), one per ubatch of ``step_plan``
        (one where it does not split), or None where a cache cannot be made static."""
        slots = full_mask.shape[1] + steps
        statics = [static_cache_from(model, caches.get(u), slots) for u in range(len(caches))]
        if not statics or any(c is None for c in statics):
            if not _STATIC_FALLBACK_LOGGED:
                _STATIC_FALLBACK_LOGGED.append(True)
                logger.warning("greedy_generate(cuda_graph=True): the cache (%s) cannot be made static; "
                               "the decode steps run eagerly", type(caches.get(0)).__name__)
            return None
        caches.update(enumerate(statics))

        def static_step(ids_b: torch.Tensor, mask4d: torch.Tensor, pos_b: torch.Tensor) -> torch.Tensor:
            info = current_ubatch()
            out = model(input_ids=ids_b, attention_mask=mask4d, position_ids=pos_b, use_cache=True,
                        logits_to_keep=1, **{cache_kw: statics[0 if info is None else info.index]})
            return out.logits[:, -1]

        def run(ids_b: torch.Tensor, mask4d: torch.Tensor, pos_b: torch.Tensor) -> torch.Tensor:
            return overlapped_forward(static_step, ids_b, mask4d, pos_b, plan=step_plan,
                                      sm_carveout=sm_carveout)

        with decode_phase(True):
            return static_decode(run, ids, positions, full_mask, slots, steps, capture=ids.is_cuda)

    # sync: where a copy-engine GPU wait can trap, wait for the stream before returning, so that a
    # wait of the last steps (or of a replayed graph, which runs no Python) that trapped fails
    # here, named, not bare at the caller's next CUDA call
    with named_device_faults(sync=True):
        return _decode(step, input_ids, mask, plan, caches, max_new_tokens, split_decode,
                       graph_steps if cuda_graph else None, sm_carveout), plan


#: the static cache's fallback is logged once per process
_STATIC_FALLBACK_LOGGED: list[bool] = []


def _decode(step: Any, input_ids: torch.Tensor, mask: torch.Tensor, plan: UBatchPlan,
            caches: dict[int, Any], max_new_tokens: int, split_decode: bool,
            graph_steps: Any = None, sm_carveout: int | None = None) -> torch.Tensor:
    """:func:`greedy_generate`'s steps: the prefill, then the decode steps; the tokens."""
    tokens, positions = input_ids, mask_positions(mask)
    ids = input_ids
    step_plan = plan
    for i in range(max_new_tokens):
        if i == 1 and plan.split and not split_decode:
            joined = join_caches([caches[u] for u in range(len(plan.slices))],
                                 [stop - start for start, stop in plan.slices])
            if joined is None:
                logger.warning("greedy_generate: the ubatches' caches (%s) cannot be joined; the "
                               "decode steps stay split", type(caches[0]).__name__)
            else:
                caches.clear()
                caches[0] = joined
                # no vote: every rank joins at the same step
                step_plan = no_split_plan(input_ids.shape[0],
                                          detail="the decode steps run plainly (split_decode=False)")
        if i == 1 and graph_steps is not None and len(caches) == len(step_plan.slices):
            # (a cache per ubatch of the decode steps' plan: one where they run plainly)
            new = graph_steps(ids, positions, mask, max_new_tokens - 1, step_plan)
            if new is not None:
                return torch.cat([tokens, new], dim=1)
        with decode_phase(i > 0):  # the decode backend, where the model has one, after the prefill
            logits = overlapped_forward(step, ids, mask, positions, plan=step_plan, sm_carveout=sm_carveout)
        ids = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, ids], dim=1)
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return tokens
