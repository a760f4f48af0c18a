"""Adapters for model libraries.

``dbo.integrations.transformers``: expert parallelism and DBO for Hugging Face transformers MoE
models (:func:`~dbo.integrations.transformers.convert_to_expert_parallel`,
:class:`~dbo.integrations.transformers.DBOPrefill`). ``dbo.integrations.backends``: the
prepare/finalize backends by name. Neither imports transformers itself.
"""
