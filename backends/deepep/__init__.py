"""What the DeepEP backends (``deepep_ht``, ``deepep_ll``, ``deepep_v2``) share: the group's
buffer and the API it was found with (:mod:`~dbo.backends.deepep.buffer`), and the base class
with the per-ubatch handles and host waits (:mod:`~dbo.backends.deepep.common`)."""
