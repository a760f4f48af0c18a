"""Hugging Face transformers MoE models with dbo: expert parallelism and dual-batch overlap.

A model becomes expert-parallel in one of two ways: :func:`convert_to_expert_parallel` on a model
in memory (:mod:`~dbo.integrations.transformers.convert`), or ``from_pretrained(...,
distributed_config=ep_distributed_config(backend))`` with dbo's backends as transformers' own
expert-parallel implementations (:mod:`~dbo.integrations.transformers.ep`; the operations on such a
loaded model in :mod:`~dbo.integrations.transformers.ep_model`). Either way :func:`use_backend`
switches its backend (:mod:`~dbo.integrations.transformers.backend`), :class:`DBOPrefill` runs
its prefill as overlapped ubatches (:mod:`~dbo.integrations.transformers.prefill`) and
:func:`~dbo.integrations.transformers.generate.greedy_generate` decodes. The rest:
:mod:`~dbo.integrations.transformers.experts`, :mod:`~dbo.integrations.transformers.fsdp`,
:mod:`~dbo.integrations.transformers.checkpoint`, :mod:`~dbo.integrations.transformers.moe_block`
and :mod:`~dbo.integrations.transformers.presets`.
"""

from dbo.integrations.transformers.backend import use_backend
from dbo.integrations.transformers.convert import (
    FAMILIES,
    MoEFamily,
    UnsupportedModelError,
    convert_to_expert_parallel,
    find_moe_blocks,
    set_backend,
)
from dbo.integrations.transformers.prefill import DBOPrefill, prefill_logits, prefill_split_config

__all__ = ["MoEFamily", "FAMILIES", "UnsupportedModelError", "find_moe_blocks",
           "convert_to_expert_parallel", "use_backend", "set_backend", "prefill_split_config",
           "prefill_logits", "DBOPrefill"]
