"""``python -m dbo.bench experts``: the routed experts alone at the overlap benchmark's shapes.

``command`` (the timer, the grid, the table, the command line, ``main``), ``options`` (what a
run is asked for: one frozen, validated value) and ``cases`` (one rank's expert inputs as a
backend delivers them).
"""

__all__: list[str] = []
