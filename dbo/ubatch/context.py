"""The ubatch context, as backends and models use it: ``run_ubatches`` and the ``dbo_*`` functions.

``run_ubatches(fns)`` runs each callable as a greenlet on the calling thread; inside, a ubatch
calls :func:`dbo_yield` to let the next one run, switches between the compute and the comm
stream, and hands recv hooks to the next ubatch. On a thread with no run every ``dbo_*``
function is a cheap no-op, so backend code runs unchanged without DBO. Semantics: ``DESIGN.md``,
"The ubatch context".

The machinery lives behind this module: :mod:`dbo.ubatch.driver` (the greenlet driver loop, the
thread-local slot that finds the active run), :mod:`dbo.ubatch.state` (:class:`UBatchContext`, one
ubatch's streams, events and hook slot), :mod:`dbo.ubatch.modes` (grad, inference and autocast
state saved and restored at every switch) and :mod:`dbo.ubatch.mode_stacks` (torch's mode stacks,
default device and saved-tensor hooks, likewise). Of these, only the driver and the state import
greenlet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from dbo.errors import NestedRunError, UBatchCountError
from dbo.ubatch.driver import noop as _noop
from dbo.ubatch.driver import run_to_completion as _run_to_completion
from dbo.ubatch.driver import tls as _driver_tls
from dbo.ubatch.sm import compute_on_sms
from dbo.ubatch.state import RecvHook, UBatchContext
from dbo.ubatch.streams import STREAM_POOL
from dbo.ubatch.trace import Trace

__all__ = [
    "UBatchContext",
    "run_ubatches",
    "default_run_device",
    "active_run",
    "dbo_enabled",
    "dbo_num_ubatches",
    "dbo_num_live_ubatches",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_token_offset",
    "dbo_current_context",
    "dbo_yield",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute_sync",
    "dbo_switch_to_compute_deferred",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_get_previous_event",
    "dbo_region",
]

# The active run's thread-local slot. Bound by assignment, not by import: CPython compiles
# ``_tls.yield_current()`` to LOAD_METHOD only on a name that no import binds, which keeps
# dbo_yield's bytecode what it was before the context was split.
_tls = _driver_tls

T = TypeVar("T")


def run_ubatches(
    fns: Sequence[Callable[[], T]],
    *,
    comm_stream: Any = None,
    token_offsets: Sequence[int] | None = None,
    trace: Trace | None = None,
    device: str | torch.device | None = None,
    compute_sms: int | None = None,
) -> list[T]:
    """Run ``fns`` (N >= 2 zero-argument callables) as interleaved ubatches on this thread.

    Returns their results in ubatch order. Ubatch 0 starts; each ``dbo_yield`` resumes the next
    live ubatch in ring order.

    Args:
        fns: the ubatch bodies.
        comm_stream: the stream for communication (default: one high-priority stream per
            device, created once and reused). A ``torch.cuda.Stream`` on CUDA, a
            :class:`dbo.ubatch.streams.LogicalStream` on the CPU stand-in.
        token_offsets: each ubatch's first row in the parent batch (default all 0).
        trace: a :class:`dbo.ubatch.trace.Trace` to record into.
        device: ``"cuda"`` (the current CUDA device) or ``"cpu"`` (the stand-in): where the
            ubatches' work runs. Default (:func:`default_run_device`): the device of
            ``comm_stream`` if given, else CUDA when this process already uses it, else the
            CPU stand-in.
        compute_sms: run the compute stream on a CUDA green context of this many SMs, so the
            others stay free for the communication kernels on the comm stream (see
            :func:`dbo.ubatch.sm.compute_on_sms`); None (default): the caller's stream.

    Raises:
        UBatchCountError: fewer than two ubatches, or ``token_offsets`` of another length.
        NestedRunError: a run is already active on this thread.
        ValueError: ``comm_stream`` is the caller's current stream, or a bad ``compute_sms``.
        dbo.ubatch.sm.SMPartitionUnsupportedError: ``compute_sms`` without CUDA green contexts.
        UBatchError: a ubatch raised; ``__cause__`` is its exception. ``KeyboardInterrupt`` and
            ``SystemExit`` propagate as they are. Either way every other started ubatch was
            unwound first and no state is left behind.
    """
    if _tls.run is not None:
        raise NestedRunError("run_ubatches called inside a running ubatch (nested runs are not "
                             "supported)")
    fns = list(fns)
    if len(fns) < 2:
        raise UBatchCountError(f"run_ubatches needs at least 2 ubatches, got {len(fns)}")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"fns[{i}] is not callable: {fn!r}")
    if token_offsets is None:
        offsets = [0] * len(fns)
    else:
        offsets = [int(o) for o in token_offsets]
        if len(offsets) != len(fns):
            raise UBatchCountError(f"token_offsets has {len(offsets)} entries for {len(fns)} "
                                   "ubatches")
    if device is None:
        device = default_run_device(comm_stream)
    if compute_sms is None:
        return _run_to_completion(fns, STREAM_POOL.get(device), comm_stream, offsets, trace)
    with compute_on_sms(compute_sms, torch.device(device)):  # which checks compute_sms
        return _run_to_completion(fns, STREAM_POOL.get(device), comm_stream, offsets, trace)


def default_run_device(comm_stream: Any = None) -> str | torch.device:
    """The device :func:`run_ubatches` runs on when it is not told: ``comm_stream``'s (a
    ``torch.cuda.Stream``'s device; the CPU stand-in for a ``LogicalStream``); else CUDA when
    this process already uses it (CUDA is initialized: it has made CUDA tensors or streams);
    else the CPU stand-in, so that CPU work on a machine with a GPU neither starts a CUDA
    context nor runs on CUDA streams. Ubatches whose work is the process's first on CUDA must
    pass ``device="cuda"``."""
    if comm_stream is not None:
        return comm_stream.device if isinstance(comm_stream, torch.cuda.Stream) else "cpu"
    return "cuda" if torch.cuda.is_initialized() else "cpu"


def active_run() -> Any:
    """The run active on this thread, or None (for tests that check nothing is left behind)."""
    return _tls.run


# ---- where am I -----------------------------------------------------------------------------


def dbo_enabled() -> bool:
    """True inside a ``run_ubatches`` on this thread."""
    return _tls.run is not None


def dbo_num_ubatches() -> int:
    """Number of ubatches of the active run (1 outside a run)."""
    run = _tls.run
    return 1 if run is None else len(run.contexts)


def dbo_num_live_ubatches() -> int:
    """Ubatches of the active run whose callables have not returned yet, the running one
    included (1 outside a run). A ubatch that waits for the others (a rendezvous) uses it to
    tell a peer that has yet to arrive from one that has finished and never will."""
    run = _tls.run
    return 1 if run is None else run.live_count


def dbo_current_context() -> UBatchContext | None:
    """The running ubatch's context, or None outside a run."""
    run = _tls.run
    return None if run is None else run.current


def dbo_current_ubatch_id() -> int:
    """Index of the running ubatch (0 outside a run)."""
    run = _tls.run
    return 0 if run is None else run.current.id


def dbo_current_ubatch_token_offset() -> int:
    """First row of the running ubatch in the parent batch (0 outside a run)."""
    run = _tls.run
    return 0 if run is None else run.current.token_offset


# ---- yielding and recv hooks ----------------------------------------------------------------


def dbo_yield() -> None:
    """Resume the next live ubatch in ring order; return when this one is resumed."""
    _tls.yield_current()


def dbo_maybe_run_recv_hook() -> None:
    """Run the recv hook that another ubatch registered into this ubatch's slot, if any."""
    run = _tls.run
    if run is not None:
        run.current.maybe_run_recv_hook()


def dbo_register_recv_hook(hook: RecvHook) -> None:
    """Hand ``hook`` to the next live ubatch; it runs before this ubatch continues.

    Outside a run the hook runs at once.
    """
    run = _tls.run
    if run is None:
        hook()
    else:
        run.current.register_recv_hook(hook)


# ---- streams ------------------------------------------------------------------------------
# Each function is a no-op outside a run; inside one it acts on the running ubatch.


def dbo_switch_to_comm() -> None:
    """Make the comm stream current, without waiting for anything."""
    run = _tls.run
    if run is not None:
        run.current.switch_to_comm()


def dbo_switch_to_compute() -> None:
    """Make the compute stream current, without waiting for anything."""
    run = _tls.run
    if run is not None:
        run.current.switch_to_compute()


def dbo_switch_to_comm_sync() -> None:
    """Make the comm stream current; it first waits for this ubatch's compute so far (the
    ubatch's compute-done event)."""
    run = _tls.run
    if run is not None:
        run.current.switch_to_comm_sync()


def dbo_switch_to_compute_sync() -> None:
    """Make the compute stream current; it first waits for this ubatch's comm so far (the
    ubatch's comm-done event)."""
    run = _tls.run
    if run is not None:
        run.current.switch_to_compute_sync()


def dbo_switch_to_compute_deferred() -> Callable[[], None]:
    """Switch to the compute stream now and return ``wait()``, which makes it wait for this
    ubatch's comm so far (see :meth:`UBatchContext.switch_to_compute_deferred`). Outside a run
    returns a no-op."""
    run = _tls.run
    if run is None:
        return _noop
    return run.current.switch_to_compute_deferred()


def dbo_yield_and_switch_from_compute_to_comm() -> None:
    """Mark this ubatch's compute done, yield, then continue on the comm stream after it.

    Raises:
        StreamStateError: the current stream is not the compute stream.
    """
    run = _tls.run
    if run is not None:
        run.current.yield_and_switch_from_compute_to_comm()


def dbo_yield_and_switch_from_comm_to_compute() -> None:
    """Mark this ubatch's comm done, yield, then continue on the compute stream after it.

    Raises:
        StreamStateError: the current stream is not the comm stream.
    """
    run = _tls.run
    if run is not None:
        run.current.yield_and_switch_from_comm_to_compute()


def dbo_get_previous_event(func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Call ``func(*args, **kwargs)`` with the compute stream current and return its result.

    With DeepEP's ``Buffer.capture`` this gives the event covering this ubatch's compute work
    so far. Outside a run returns None without calling ``func``.
    """
    run = _tls.run
    if run is None:
        return None
    streams = run.streams
    prev = streams.current()
    streams.set_current(run.compute_key)
    try:
        return func(*args, **kwargs)
    finally:
        streams.set_current(prev)


@contextmanager
def dbo_region(name: str) -> Iterator[None]:
    """Mark a named region of the running ubatch in the run's trace (and NVTX on CUDA).

    A no-op outside a run or when the run has no trace. Regions may span yields.
    """
    run = _tls.run
    trace = None if run is None else run.trace
    if trace is None:
        yield
        return
    ub = run.current.id
    trace.region_begin(ub, name)
    try:
        yield
    finally:
        trace.region_end(ub, name)
