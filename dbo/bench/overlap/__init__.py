"""``python -m dbo.bench overlap``: how much of the all-to-all dual-batch overlap hides, per MoE
layer.

``command`` (the runs over the grid, the bundle, the verdict, ``main``), ``options`` (what a run
is asked for: one frozen, validated value), ``args`` (the command line that builds it),
``shape`` (one shape's measurements), ``wrapper`` (the ``DBOWrapper`` rows and their autotune),
``model`` (the benchmark's model and its stand-ins), ``link`` (the link limit of the
communication), ``capture`` (CUDA-graph and trace captures), ``record`` (what a run measured, and
the bundle's JSON), ``summary`` (a shape's figures and their definitions), ``report`` (table,
plot).
"""

__all__: list[str] = []
