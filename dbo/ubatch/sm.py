"""How many SMs a DBO run's compute may use: the SM carve-out and SM partitioning.

On Hopper a large GEMM holds every SM until it finishes, so a communication kernel launched
behind it (DeepEP's normal mode takes 24-48 SMs) waits for it, and the overlap is lost
(docs/performance.md). A green context is a CUDA context confined to a set of SMs: kernels
launched on its stream never run elsewhere, so the SMs outside it stay free for the
communication kernels of the other ubatch, launched on the (ordinary) comm stream.

Two ways to leave SMs to the communication kernels, both checked and applied here:

* ``sm_carveout=N`` (:func:`sm_carveout`): the matmuls leave ``N`` SMs free. cuBLASLt and
  ``torch._grouped_mm`` read torch's experimental carve-out, which the block sets; dbo's
  persistent expert kernels read the same number from a context variable the block sets too
  (:func:`current_experts_sm_carveout`, read by :class:`dbo.experts.SwiGLUExperts` at each
  launch, wherever the experts sit in a model). The overlapped forward enters the block around
  its run (:meth:`dbo.run_options.RunOptions.applied`); nothing else writes torch's setting.
* ``compute_sms=N`` (:func:`compute_on_sms`): the compute runs on a green context of ``N`` SMs.

:func:`compute_on_sms` makes the caller's work inside the block run on a green-context stream
of ``num_sms`` SMs, ordered after the caller's stream on entry and before it on exit, so the
block is a drop-in around :func:`dbo.run_ubatches` (whose compute stream is the current stream
when it starts). The green contexts and their streams are created once per (device, num_sms)
and kept in :data:`PARTITIONS` (``reset()`` drops them), so a run on a partition can be
captured in a CUDA graph (tests/gpu/test_partition_gpu.py captures one and replays it; H100,
torch 2.11).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dbo.errors import DBOError

__all__ = [
    "SMPartitionUnsupportedError",
    "PartitionPool",
    "PARTITIONS",
    "green_contexts_supported",
    "torch_sm_carveout_supported",
    "check_sm_carveout",
    "check_compute_sms",
    "sm_carveout",
    "experts_sm_carveout",
    "current_experts_sm_carveout",
    "compute_on_sms",
]

logger = logging.getLogger(__name__)


class SMPartitionUnsupportedError(DBOError, RuntimeError):
    """SM partitioning was asked for where CUDA green contexts are not available."""


def green_contexts_supported() -> bool:
    """True when torch has CUDA green contexts and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return False
    return bool(getattr(green_contexts, "SUPPORTED", False))


def torch_sm_carveout_supported() -> bool:
    """True when this torch has the experimental SM carve-out that :func:`sm_carveout` sets."""
    return hasattr(torch._C, "_set_sm_carveout_experimental") and \
        hasattr(torch._C, "_get_sm_carveout_experimental")


def check_sm_carveout(num_sms: Any) -> int | None:
    """``num_sms`` unchanged when it is a valid ``sm_carveout`` (None or an int >= 0).

    Raises:
        ValueError: anything else (a bool, a float, a negative int).
    """
    return _check_num_sms(num_sms, 0, "sm_carveout must be a non-negative int or None")


def check_compute_sms(num_sms: Any) -> int | None:
    """``num_sms`` unchanged when it is a valid ``compute_sms`` (None or an int >= 1).

    Raises:
        ValueError: anything else (a bool, a float, zero or less).
    """
    return _check_num_sms(num_sms, 1, "compute_sms must be a positive int or None")


def _check_num_sms(num_sms: Any, least: int, want: str) -> int | None:
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                or num_sms < least):
        raise ValueError(f"{want}, got {num_sms!r}")
    return num_sms


#: the experts' carve-out in force (None: each experts object's own); a context variable, so a
#: value set around ``run_ubatches`` reaches every ubatch of that run and nothing else
_EXPERTS_CARVEOUT: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dbo_experts_sm_carveout", default=None)


def current_experts_sm_carveout(default: int | None = None) -> int | None:
    """The SMs dbo's persistent expert kernels leave free here: the innermost
    :func:`sm_carveout` or :func:`experts_sm_carveout` block's, else ``default`` (the experts'
    own ``sm_carveout``)."""
    value = _EXPERTS_CARVEOUT.get()
    return default if value is None else value


@contextlib.contextmanager
def experts_sm_carveout(num_sms: int | None) -> Iterator[None]:
    """Within the block (in this context, and in the ubatches of a run started inside it), dbo's
    persistent expert kernels leave ``num_sms`` SMs free (:func:`current_experts_sm_carveout`);
    torch's setting is left alone. The previous value is restored on exit. ``None`` does
    nothing.

    Unlike torch's process-wide carve-out, this one is per context: a block inside a ubatch
    that spans a yield does not reach the other ubatch.

    Raises:
        ValueError: ``num_sms`` is negative or not an int.
    """
    if check_sm_carveout(num_sms) is None:
        yield
        return
    token = _EXPERTS_CARVEOUT.set(num_sms)
    try:
        yield
    finally:
        _EXPERTS_CARVEOUT.reset(token)


@contextlib.contextmanager
def sm_carveout(num_sms: int | None) -> Iterator[None]:
    """Leave ``num_sms`` SMs to other kernels in the matmuls launched inside the block.

    Sets torch's experimental SM carve-out (``torch._C._set_sm_carveout_experimental``): cuBLASLt
    matmuls target that many fewer SMs, and the persistent CUTLASS kernels of
    ``torch._grouped_mm`` size their grid to the rest. Under DBO this keeps SMs free for the
    other ubatch's communication kernels (DeepEP's normal mode runs on ``Buffer.num_sms`` SMs),
    which otherwise wait for a persistent GEMM to finish. dbo's own persistent expert kernels
    get the same number (:func:`experts_sm_carveout`). Both previous values are restored on exit
    (also on an exception). ``None`` does nothing.

    torch's setting is process-wide: enter the block around a whole run (as the overlapped
    forward does), never inside a ubatch across a yield, where the ubatches' exits would
    restore it out of order.

    Raises:
        ValueError: ``num_sms`` is negative or not an int.
        RuntimeError: this torch has no SM carve-out.
    """
    if check_sm_carveout(num_sms) is None:
        yield
        return
    if not torch_sm_carveout_supported():
        raise RuntimeError(f"sm_carveout={num_sms}: torch {torch.__version__} has no "
                           "_set_sm_carveout_experimental")
    setter, getter = torch._C._set_sm_carveout_experimental, torch._C._get_sm_carveout_experimental
    previous = getter()
    setter(num_sms)
    try:
        with experts_sm_carveout(num_sms):
            yield
    finally:
        setter(previous)


class PartitionPool:
    """Green contexts and their streams, one per ``(device index, num_sms)``, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int], tuple[Any, torch.cuda.Stream]] = {}

    def stream(self, num_sms: int, device: int) -> torch.cuda.Stream:
        """The stream of a green context of ``num_sms`` SMs on CUDA device ``device``.

        Raises:
            ValueError: ``num_sms`` is not in ``[1, the device's SM count]``.
            SMPartitionUnsupportedError: no green contexts in this torch / on this machine.
        """
        key = (device, num_sms)
        with self._lock:
            hit = self._streams.get(key)
            if hit is not None:
                return hit[1]
            if not green_contexts_supported():
                raise SMPartitionUnsupportedError(
                    f"compute_sms={num_sms}: CUDA green contexts are not available (torch "
                    f"{torch.__version__}, CUDA available: {torch.cuda.is_available()}); run "
                    "without compute_sms, or use sm_carveout")
            total = torch.cuda.get_device_properties(device).multi_processor_count
            if not 1 <= num_sms <= total:
                raise ValueError(f"compute_sms={num_sms}: device {device} has {total} SMs")
            from torch.cuda.green_contexts import GreenContext

            ctx = GreenContext.create(num_sms=num_sms, device_id=device)
            stream = ctx.Stream()
            self._streams[key] = (ctx, stream)
            logger.info("dbo: green context of %d of %d SMs on cuda:%d", num_sms, total, device)
            return stream

    def __len__(self) -> int:
        return len(self._streams)

    def reset(self) -> None:
        """Forget every green context (after the work on their streams is done)."""
        with self._lock:
            self._streams.clear()


#: the process's green contexts (see :class:`PartitionPool`)
PARTITIONS = PartitionPool()


@contextlib.contextmanager
def compute_on_sms(num_sms: int | None, device: torch.device | int | None = None
                   ) -> Iterator[Any]:
    """Run the block's CUDA work on a green context of ``num_sms`` SMs of ``device``.

    The green context's stream waits for the caller's current stream on entry and is current
    inside the block; on exit (also on an exception) the caller's stream waits for it and is
    current again. Tensors allocated inside belong to the green stream's pool, like any
    side stream's. ``None`` does nothing (yields the current stream).

    Raises:
        ValueError: a bad ``num_sms``.
        SMPartitionUnsupportedError: ``num_sms`` given without CUDA green contexts (a CPU
            device included).
    """
    if check_compute_sms(num_sms) is None:
        yield None
        return
    dev = torch.device("cuda", device) if isinstance(device, int) else \
        torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise SMPartitionUnsupportedError(f"compute_sms={num_sms} needs a CUDA device, got {dev}")
    if not green_contexts_supported():
        raise SMPartitionUnsupportedError(
            f"compute_sms={num_sms}: CUDA green contexts are not available (torch "
            f"{torch.__version__}, CUDA available: {torch.cuda.is_available()})")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    green = PARTITIONS.stream(num_sms, index)
    caller = torch.cuda.current_stream(index)
    green.wait_stream(caller)
    try:
        with torch.cuda.stream(green):
            yield green
    finally:
        caller.wait_stream(green)
