"""The emulated buffer's streams and events, as DeepEP's calls use them: its own comm stream, a
kernel run on it after an event (or on the current stream), and the event or join that ends it.
On CUDA these are CUDA streams and events; on the CPU stand-in, :mod:`dbo.ubatch.streams`'
logical ones (the work itself runs at once)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dbo.ubatch.streams import (
    LogicalEvent,
    LogicalStream,
    cuda_current_stream,
    current_logical_stream,
    on_cuda_stream,
)

__all__ = ["StreamEvent", "EventOverlap", "Streams"]

class StreamEvent:
    """An event on a CUDA stream, or on the CPU stand-in's logical one."""

    def __init__(self, device: torch.device, stream: Any = None):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else cuda_current_stream(device))
        else:
            self.event = LogicalEvent("emulated deep_ep")
            self.event.record(stream if stream is not None else current_logical_stream())

    def current_stream_wait(self) -> None:
        if self.cuda:
            cuda_current_stream(self.device).wait_event(self.event)
        else:
            current_logical_stream().wait_event(self.event)


class EventOverlap:
    """``deep_ep.EventOverlap``: an event (or None) and the tensors kept alive until it is waited
    on."""

    def __init__(self, event: StreamEvent | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait() on an event that was not captured "
                               "(async_finish was not set)")
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Streams:
    """The buffer's own comm stream and the stream bookkeeping of one DeepEP call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.comm: Any = (torch.cuda.Stream(device=device) if device.type == "cuda"
                          else LogicalStream("emulated deep_ep"))
        #: the streams current when each open kernel began (what finish() joins)
        self._callers: list[Any] = []
        #: one CUDA event for every record-then-wait at once: a stream's wait takes the event's
        #: state when it is queued, so the event can be recorded again right after
        self._handoff = torch.cuda.Event() if device.type == "cuda" else None

    def join(self, waiter: Any, stream: Any) -> None:
        """``waiter`` waits for what ``stream`` has queued so far."""
        if self._handoff is None:
            _wait(waiter, StreamEvent(self.device, stream))
            return
        self._handoff.record(stream)
        waiter.wait_event(self._handoff)

    def host_wait(self, stream: Any) -> None:
        """The host waits for what the CUDA ``stream`` has queued so far."""
        self._handoff.record(stream)
        self._handoff.synchronize()

    def current(self) -> Any:
        if self.device.type == "cuda":
            return cuda_current_stream(self.device)
        return current_logical_stream()

    @contextlib.contextmanager
    def kernel(self, previous_event: Any, on_current: bool) -> Iterator[Any]:
        """Run the block on the comm stream after ``previous_event`` (else after the current
        stream), or on the current stream; yields the stream. No yield inside."""
        current = self.current()
        self._callers.append(current)
        try:
            if on_current:
                yield current
                return
            yield from self._on_comm(previous_event, current)
        finally:
            self._callers.pop()

    def _on_comm(self, previous_event: Any, current: Any) -> Iterator[Any]:
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            _wait(self.comm, ev)
        else:
            self.join(self.comm, current)
        if self.device.type == "cuda":
            with on_cuda_stream(self.comm):
                yield self.comm
        else:
            yield self.comm

    def finish(self, stream: Any, async_finish: bool, tensors: tuple = ()) -> EventOverlap:
        """After a kernel on ``stream`` (inside :meth:`kernel`'s block): its event
        (``async_finish``), else the stream that was current when the kernel began waits for it."""
        if async_finish:
            return EventOverlap(StreamEvent(self.device, stream), tensors)
        current = self._callers[-1]
        if stream is not current:
            self.join(current, stream)
        return EventOverlap(None)


def _wait(stream: Any, event: StreamEvent) -> None:
    """``stream`` (a CUDA or a logical stream) waits for ``event``."""
    stream.wait_event(event.event)
