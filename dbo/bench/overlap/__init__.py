"""``python -m dbo.bench overlap``: how much of the all-to-all dual-batch overlap hides, per MoE
layer.

``command`` (the runs over the grid, the bundle, the verdict, ``main``), ``args`` (its command
line), ``shape`` (one shape's measurements), ``wrapper`` (the ``DBOWrapper`` rows and their
autotune), ``model`` (the benchmark's model and its stand-ins), ``link`` (the link limit of the
communication), ``capture`` (CUDA-graph and trace captures), ``report`` (summaries, table, plot).
"""

__all__: list[str] = []
