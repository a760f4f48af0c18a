"""Greedy generation with a KV cache, every step (prefill and decode) as overlapped ubatches.

The split is decided once, at the prefill (one vote over the group), and kept for every decode
step: ubatch ``i`` always holds the same sequences (plus the same padding rows), so it keeps its
own KV cache (a transformers ``Cache`` per ubatch, created by the model at the prefill). Every
rank of the group runs the same number of steps (the MoE layers are collective), so
``max_new_tokens`` must be the same everywhere and there is no early stop.

The decode steps (every step after the prefill) run inside
:func:`~dbo.integrations.hf_ep.decode_phase`: a model whose experts have a decode backend
(``switch_ep_backend(model, "deepep_ht", decode_backend="deepep_ll")``, or the ``dbo_deepep``
implementation) moves the prompt through the first and each new token through the second.

Why not ``model.generate``: it drives one cache for the whole batch, and transformers 5.x has
no public way to split a cache by batch rows or join ubatch caches back (``batch_split`` /
``from_batch_splits`` are gone), which a per-step split decision would need whenever it changes.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.integrations.hf_ep import decode_phase, expert_parallel_group, prepare_for_overlap
from dbo.integrations.moe_block import routing_token_mask
from dbo.overlap import current_ubatch, overlapped_forward
from dbo.split import SplitConfig, UBatchPlan, plan_ubatches

__all__ = ["greedy_generate"]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # as transformers' generate: left padding does not shift the real tokens' positions
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def greedy_generate(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
                    config: SplitConfig | None = None, group: Any = None,
                    mask_padding_tokens: bool = True) -> tuple[torch.Tensor, UBatchPlan]:
    """Greedy decoding of ``max_new_tokens`` tokens, overlapped when the group splits.

    Args:
        model: a (converted) transformers causal LM.
        input_ids: ``[batch, seq]`` int64 prompts, left-padded.
        attention_mask: ``[batch, seq]`` 1 real, 0 padding (None: all real).
        max_new_tokens: decode steps (>= 1), the same on every rank of ``group``.
        config: the split (rows are sequences; default: split from 2 sequences).
        group: the expert-parallel group (agrees on the split once, at the prefill; default: the
            group of a model loaded with dbo's expert-parallel implementations, else the default
            group). A model loaded with FSDP2 is first :func:`~dbo.integrations.hf_fsdp.prepare_for_overlap`'d
            (a no-op once it has run a forward).
        mask_padding_tokens: route prompt padding to no expert.

    Returns:
        ``(tokens [batch, seq + max_new_tokens] int64, plan)``: the prompts followed by the
        generated tokens, and the split every step used.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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

    def step(ids: torch.Tensor, full_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        info = current_ubatch()
        index = 0 if info is None else info.index
        routing = full_mask[:, -ids.shape[1]:] if mask_padding_tokens else None
        with routing_token_mask(routing):
            out = model(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                        past_key_values=caches.get(index), use_cache=True, logits_to_keep=1)
        caches[index] = out.past_key_values
        return out.logits[:, -1]

    tokens, positions = input_ids, _positions(mask)
    ids = input_ids
    for i in range(max_new_tokens):
        with decode_phase(i > 0):  # the decode backend, where the model has one, after the prefill
            logits = overlapped_forward(step, ids, mask, positions, plan=plan)
        ids = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, ids], dim=1)
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return tokens, plan
