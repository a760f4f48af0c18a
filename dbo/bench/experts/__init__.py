"""``python -m dbo.bench experts``: the routed experts alone at the overlap benchmark's shapes.

``command`` (the timer, the grid, the table, the command line, ``main``), ``options`` (what a
run is asked for: one frozen, validated value), ``cases`` (one rank's expert inputs as a
backend delivers them) and ``record`` (what a run measured: typed rows and the run's result,
that the table, the verdict and the ``--json`` file read).
"""

__all__: list[str] = []
