"""Hugging Face transformers MoE models with dbo: expert parallelism and dual-batch overlap.

:mod:`~dbo.integrations.transformers.convert` (find a model's MoE blocks, convert them to
expert-parallel ones, :class:`DBOPrefill`), :mod:`~dbo.integrations.transformers.ep` (dbo's
backends as transformers' own expert-parallel implementations, ``from_pretrained(...,
distributed_config=...)``), :mod:`~dbo.integrations.transformers.ep_model` (the dbo layers of
such a loaded model), :mod:`~dbo.integrations.transformers.experts`,
:mod:`~dbo.integrations.transformers.fsdp`, :mod:`~dbo.integrations.transformers.checkpoint`,
:mod:`~dbo.integrations.transformers.generate` (greedy generation with overlapped prefill),
:mod:`~dbo.integrations.transformers.moe_block` and
:mod:`~dbo.integrations.transformers.presets`.
"""

from dbo.integrations.transformers.convert import (
    FAMILIES,
    DBOPrefill,
    MoEFamily,
    UnsupportedModelError,
    convert_to_expert_parallel,
    find_moe_blocks,
    prefill_logits,
    prefill_split_config,
    set_backend,
)

__all__ = ["MoEFamily", "FAMILIES", "UnsupportedModelError", "find_moe_blocks",
           "convert_to_expert_parallel", "set_backend", "prefill_split_config", "prefill_logits",
           "DBOPrefill"]
