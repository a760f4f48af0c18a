"""Adapters for model libraries.

``dbo.integrations.transformers``: expert parallelism and DBO for Hugging Face transformers MoE
models (:func:`~dbo.integrations.transformers.convert_to_expert_parallel`,
:class:`~dbo.integrations.transformers.DBOPrefill`); ``moe_block``: the expert-parallel block it
puts in; ``generate``: greedy generation with a KV cache per ubatch; ``hf_presets``: configs
built from transformers' config classes (tiny ones and full-size shapes).
``dbo.integrations.backends``: the prepare/finalize backends by name. Only ``hf_presets``
imports transformers (when called).
"""
