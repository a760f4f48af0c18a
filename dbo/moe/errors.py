"""Errors of the MoE layer that are protocol violations, not caller mistakes about values."""

from __future__ import annotations

from dbo.errors import DBOError

__all__ = ["MoEProtocolError"]


class MoEProtocolError(DBOError, RuntimeError):
    """A backend was driven out of order: ``finalize`` with no ``prepare`` in this ubatch, or
    a second ``prepare`` before the first one's ``finalize``."""
