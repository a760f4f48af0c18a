"""Measure where dual-batch overlap pays, and choose: the split threshold and the experts'
schedule (:mod:`dbo.autotune.split`), and the backend (:mod:`dbo.autotune.backend`)."""

from dbo.autotune.backend import BackendChoice, autotune_backend, pick_backend, wrapper_ms
from dbo.autotune.split import (
    NEVER_SPLIT,
    AutotuneResult,
    AutotuneRow,
    autotune_split_config,
    pick_schedule,
    pick_threshold,
)

__all__ = ["NEVER_SPLIT", "AutotuneRow", "AutotuneResult", "pick_threshold", "pick_schedule",
           "autotune_split_config", "BackendChoice", "wrapper_ms", "pick_backend", "autotune_backend"]
