"""The project's own exceptions.

Caller mistakes also subclass ``ValueError``/``TypeError``; protocol violations subclass
``RuntimeError``. Every error raised inside a ubatch surfaces as the ``__cause__`` of the
``UBatchError`` that :func:`dbo.run_ubatches` raises.
"""

from __future__ import annotations

__all__ = [
    "DBOError",
    "UBatchError",
    "UBatchCountError",
    "NestedRunError",
    "HookMisuseError",
    "HookSlotOccupiedError",
    "StreamStateError",
    "CollectiveTimeoutError",
    "CheckpointError",
    "DeviceMemoryError",
]


class DBOError(Exception):
    """Base class of every error dbo raises on purpose."""


class UBatchError(DBOError):
    """A ubatch (or a recv hook it ran) raised; the original exception is ``__cause__``.

    ``ubatch_id`` is the index of the failing ubatch in the ``fns`` given to ``run_ubatches``.
    """

    def __init__(self, ubatch_id: int, cause: BaseException):
        self.ubatch_id = ubatch_id
        super().__init__(f"ubatch {ubatch_id} failed: {type(cause).__name__}: {cause}")


class UBatchCountError(DBOError, ValueError):
    """``run_ubatches`` needs at least two ubatches (and matching per-ubatch arguments)."""


class NestedRunError(DBOError, RuntimeError):
    """``run_ubatches`` was called while a run is active on this thread."""


class HookMisuseError(DBOError, RuntimeError):
    """A recv hook tried to yield or to register another hook."""


class HookSlotOccupiedError(DBOError, RuntimeError):
    """A recv hook was registered into a slot that still holds an unrun hook."""


class StreamStateError(DBOError, RuntimeError):
    """A ``dbo_yield_and_switch_*`` call was made from the wrong stream."""


class CollectiveTimeoutError(DBOError, TimeoutError):
    """A collective did not complete in time (a peer rank failed or stopped).

    Where the backend knows them: ``backend``, ``phase`` (``"dispatch"``, ``"combine"``, with
    ``" send"``/``" receive"`` where the library splits them), ``ubatch`` and
    ``missing_ranks`` (the ranks that did not arrive); otherwise None / ``()``.
    """

    def __init__(self, message: str, *, backend: str | None = None, phase: str | None = None,
                 ubatch: int | None = None, missing_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.backend = backend
        self.phase = phase
        self.ubatch = ubatch
        self.missing_ranks = tuple(missing_ranks)

    def __reduce__(self) -> tuple:  # keep the attributes across processes (pickle)
        return (type(self), (str(self),), dict(self.__dict__))


class CheckpointError(DBOError, ValueError):
    """A checkpoint cannot be loaded as it is: a shard file listed in its index is absent or
    truncated, or a layer lacks an expert's weights or holds one of another shape. The message
    names the file or the key and what was expected."""


class DeviceMemoryError(DBOError, MemoryError):
    """A rank of the group has less device memory free than a call needs even unsplit (by the
    autotune's measure), so no rank ran it: raised on every rank before the call's first
    all-to-all, which leaves the group in step and the model usable for a smaller call.
    ``.rank`` is the lowest rank short of memory, ``.free_bytes`` the least free memory and
    ``.need_bytes`` the largest need among the short ranks (in whole MiB)."""

    def __init__(self, message: str, *, rank: int | None = None, free_bytes: int | None = None,
                 need_bytes: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.free_bytes = free_bytes
        self.need_bytes = need_bytes

    def __reduce__(self) -> tuple:  # keep the attributes across processes (pickle)
        return (type(self), (str(self),), dict(self.__dict__))
