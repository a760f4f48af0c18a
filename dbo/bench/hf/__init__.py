"""``python -m dbo.bench hf-prefill|hf-generate|hf-load``: a transformers MoE model made
expert-parallel by dbo.

One module per command (``prefill``, ``generate``, ``load``), with the record, table and verdict
of each beside it (``prefill_table``, ``generate_table``, ``load_table``); the parts they share:
``options`` (what a run is asked for, as frozen, validated values: the model's options and each
command's), ``args`` (the model's command-line arguments and their checks) and ``model`` (the
model built with seeded random weights, or written as a checkpoint and loaded expert-parallel).
"""

__all__: list[str] = []
