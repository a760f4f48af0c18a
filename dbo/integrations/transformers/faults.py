"""Name the CUDA errors that a backend's GPU wait for a dead or stalled peer leaves behind.

The copy-engine backend's GPU wait for a peer's signal traps after its timeout; the trap leaves
the CUDA context unusable, and the next CUDA call (a sync, an ``.item()``, the next kernel) fails
with a bare "unspecified launch failure" that says nothing of the peer. :func:`named_device_faults`
turns such an error, raised inside its block, into the
:class:`~dbo.errors.CollectiveTimeoutError` that names the wait (the CUDA error as its cause);
:class:`~dbo.integrations.transformers.DBOPrefill` and
:func:`~dbo.integrations.transformers.generate.greedy_generate` run inside one. A prefill returns before
its GPU work ends, so a wait that fails late in it would fail at the caller's next CUDA call,
outside the block: ``DBOPrefill`` (``sync_faults=True``, the default) waits for the stream at its
end where such a wait can trap. The process must end after either: the GPU cannot run anything
more.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from dbo.errors import CollectiveTimeoutError

__all__ = ["named_device_faults", "device_fault_for", "gpu_waits_can_trap"]


def device_fault_for(exc: BaseException) -> CollectiveTimeoutError | None:
    """The named error behind ``exc`` (or an exception in its cause chain): a CUDA error left
    by a backend's failed GPU wait for a peer; None for anything else."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    if not any(isinstance(e, RuntimeError) and "CUDA error" in str(e) for e in chain):
        return None
    copy_engine = sys.modules.get("dbo.backends.copy_engine")  # only where it ran
    return None if copy_engine is None else copy_engine.device_wait_fault()


def gpu_waits_can_trap() -> bool:
    """Whether a backend of this process waits for its peers inside GPU kernels that trap after
    their timeout (a live copy-engine transport on CUDA)."""
    copy_engine = sys.modules.get("dbo.backends.copy_engine")  # only where it ran
    return copy_engine is not None and copy_engine.gpu_waits_live()


@contextlib.contextmanager
def named_device_faults(sync: bool = False) -> Iterator[None]:
    """Within the block, a CUDA error caused by a backend's failed wait for a peer is raised as
    the :class:`~dbo.errors.CollectiveTimeoutError` naming it (see the module docstring).

    ``sync``: at the block's end, where a backend's GPU wait can trap
    (:func:`gpu_waits_can_trap`), wait for the current CUDA stream, so that a wait that failed
    during the block fails here, named, rather than at the caller's next CUDA call, bare."""
    try:
        yield
        if sync and gpu_waits_can_trap() and torch.cuda.is_initialized() \
                and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
    except Exception as exc:  # noqa: BLE001 - re-raised unless it names a failed GPU wait
        named = device_fault_for(exc)
        if named is None:
            raise
        raise named from exc
