"""The ubatch context, the heart of dbo: ubatches as greenlets on one thread, taking turns on a
compute and a comm stream.

:mod:`~dbo.ubatch.context` (``run_ubatches`` and the ``dbo_*`` functions, as backends and models
call them), :mod:`~dbo.ubatch.driver` (the greenlet loop; the only module that imports
greenlet), :mod:`~dbo.ubatch.state` (one ubatch's streams, events and hook slot),
:mod:`~dbo.ubatch.modes` (grad, inference and autocast state saved at every switch),
:mod:`~dbo.ubatch.streams` (streams and events, on CUDA or as logical stand-ins on CPU),
:mod:`~dbo.ubatch.trace` (the schedule's trace) and :mod:`~dbo.ubatch.sm` (how many SMs the
compute may use). ``from dbo import ...`` gives the public names.
"""
