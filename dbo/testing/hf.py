"""What the transformers tests share: a rank's left-padded prompts and a float32 load of a
checkpoint, whole or expert-parallel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["left_padded_prompts", "load_float32"]


def left_padded_prompts(seed: int, pads: Sequence[int], seq: int, vocab: int = 64
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [len(pads), seq] int64, mask)``: random tokens from ``seed``, sequence ``i`` with
    ``pads[i]`` padding positions on the left (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(pads), seq), generator=g)
    mask = torch.ones_like(ids)
    for i, pad in enumerate(pads):
        mask[i, :pad] = 0
    return ids, mask


def load_float32(path: str, distributed_config: Any = None) -> torch.nn.Module:
    """``from_pretrained(path)`` in float32, whole (no ``distributed_config``) or with it."""
    from transformers import AutoModelForCausalLM

    kw = {} if distributed_config is None else {"distributed_config": distributed_config}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
