"""Adapters for model libraries.

``dbo.integrations.transformers``: expert parallelism and DBO for Hugging Face transformers MoE
models (:func:`~dbo.integrations.transformers.convert_to_expert_parallel`,
:class:`~dbo.integrations.transformers.DBOPrefill`); ``hf_ep``: dbo's backends as transformers'
own expert-parallel implementations (``from_pretrained(..., distributed_config=...)``,
transformers >= 5.23); ``hf_ep_model``: such a loaded model's dbo layers, their group, switching
their backend or experts; ``hf_fsdp``: transformers' FSDP2 wrapper of such a model made fit for
inference mode and overlap (at its first forward); ``moe_block``: the expert-parallel block the
conversion puts in; ``generate``: greedy generation with a KV cache per ubatch; ``hf_presets``:
configs built from transformers' config classes (tiny ones and full-size shapes).
``dbo.integrations.backends``: the prepare/finalize backends by name. ``hf_ep`` imports
transformers when it is imported (to register its names; nothing happens without transformers),
``hf_presets`` when called.
"""
