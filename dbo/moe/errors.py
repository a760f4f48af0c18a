"""Errors of the MoE layer that are protocol violations, not caller mistakes about values."""

from __future__ import annotations

from dbo.errors import DBOError

__all__ = ["MoEProtocolError", "MergedScheduleError"]


class MoEProtocolError(DBOError, RuntimeError):
    """A backend was driven out of order: ``finalize`` with no ``prepare`` in this ubatch, or
    a second ``prepare`` before the first one's ``finalize``."""


class MergedScheduleError(DBOError, RuntimeError):
    """The merged expert schedule cannot proceed: a ubatch waits at a layer's experts for a
    peer that finished without reaching them, the ubatches called the layer with different
    weights, or their received tensors cannot be concatenated."""
