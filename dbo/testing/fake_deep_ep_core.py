"""What the fake ``deep_ep`` modes share: errors, events and streams, config, byte packing, the
gloo row exchange, and the state every fake buffer has.

:mod:`dbo.testing.fake_deep_ep` (the v1 ``Buffer``, normal mode, and the module facade),
:mod:`dbo.testing.fake_deep_ep_ll` (low-latency mode) and :mod:`dbo.testing.fake_deep_ep_v2`
(``ElasticBuffer``/``EPBuffer``) build on this module and never on each other's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dbo.ubatch.streams import LogicalEvent, LogicalStream, current_logical_stream

__all__ = [
    "FakeDeepEPError",
    "EventHandle",
    "EventOverlap",
    "Config",
    "Kernel",
    "FakeBufferBase",
    "topk_idx_t",
    "check",
    "exchange_rows",
    "to_bytes",
    "from_bytes",
    "fill_garbage",
]

topk_idx_t = torch.int64


class FakeDeepEPError(RuntimeError):
    """What the real DeepEP reports through a failed host assert, or a hang the fake detects."""


def check(cond: bool, msg: str) -> None:
    """Raise :class:`FakeDeepEPError` with ``msg`` unless ``cond`` (DeepEP's host asserts)."""
    if not cond:
        raise FakeDeepEPError(f"fake deep_ep: {msg}")


# ---- events and streams -------------------------------------------------------------------


class EventHandle:
    """``deep_ep_cpp.EventHandle``: an event recorded on ``stream`` (default: the current one)."""

    def __init__(self, stream: LogicalStream | None = None):
        self.event = LogicalEvent("deep_ep")
        self.event.record(stream if stream is not None else current_logical_stream())

    def current_stream_wait(self) -> None:
        current_logical_stream().wait_event(self.event)


class EventOverlap:
    """``deep_ep.EventOverlap``: an optional :class:`EventHandle` plus tensors kept alive."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._hooks: list[Callable[[], Any]] = []

    def current_stream_wait(self) -> None:
        check(self.event is not None, "EventOverlap.current_stream_wait() on an event that was not "
                                      "captured (async_finish was not set)")
        self.event.current_stream_wait()
        for hook in self._hooks:
            hook()
        self._hooks.clear()

    def register_hook_after_wait(self, hook: Callable[[], Any]) -> None:
        self._hooks.append(hook)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Config:
    """``deep_ep_cpp.Config``: SM count and chunk sizes, with the buffer size hints."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = self.num_sms // 2
        return channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 64)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else self.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)


class Kernel:
    """Stream bookkeeping of one DeepEP call, as the C++ does it."""

    def __init__(self, comm: LogicalStream, previous_event: Any, async_finish: bool,
                 allocate_on_comm_stream: bool, on_current_stream: bool = False):
        if allocate_on_comm_stream:
            check(previous_event is not None and async_finish,
                  "allocate_on_comm_stream needs previous_event and async_finish")
        self.compute = current_logical_stream()
        self.stream = self.compute if on_current_stream else comm
        self.async_finish = async_finish
        if not on_current_stream:
            ev = getattr(previous_event, "event", previous_event)
            if ev is not None:
                inner = ev.event if isinstance(ev, EventHandle) else ev
                self.stream.wait_event(inner)
            else:
                self.stream.wait_event(_record(self.compute))

    def finish(self, tensors: tuple = ()) -> EventOverlap:
        if self.async_finish:
            return EventOverlap(EventHandle(self.stream), tensors)
        if self.stream is not self.compute:
            self.compute.wait_event(_record(self.stream))
        return EventOverlap(None)


def _record(stream: LogicalStream) -> LogicalEvent:
    ev = LogicalEvent("deep_ep")
    ev.record(stream)
    return ev


# ---- byte packing and exchange ------------------------------------------------------------


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` any dtype -> ``[N, nbytes]`` uint8 (a copy if not contiguous)."""
    n = t.shape[0]
    width = 1
    for d in t.shape[1:]:
        width *= d
    flat = t.contiguous().reshape(n, width)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8) if flat.shape[1] else flat.new_empty((n, 0), dtype=torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, tail: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`to_bytes`: ``[N, nbytes]`` uint8 -> ``[N, *tail]`` of ``dtype``."""
    n = b.shape[0]
    if b.shape[1] == 0:
        return torch.empty((n, *tail), dtype=dtype)
    return b.contiguous().view(dtype).reshape(n, *tail)


def exchange_rows(group: Any, rows: torch.Tensor, send_counts: list[int],
                  recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """All-to-all of uint8 rows: ``rows[sum(send_counts[:r]):...]`` go to rank ``r``.

    Returns the received rows, ordered by source rank, and how many came from each rank.
    """
    if recv_counts is None:
        sc = torch.tensor(send_counts, dtype=torch.int64)
        rc = torch.empty_like(sc)
        dist.all_to_all_single(rc, sc, group=group)
        recv_counts = rc.tolist()
    out = torch.empty((sum(recv_counts), rows.shape[1]), dtype=torch.uint8)
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out, recv_counts


def fill_garbage(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what a not-yet-received DeepEP output holds: NaN (floats), -7 (ints)."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-7)
    return t


# ---- the state every fake buffer has ------------------------------------------------------


class FakeBufferBase:
    """A fake buffer's group, its own comm stream, its call log and ``destroy()``."""

    def _init_base(self, group: Any, explicitly_destroy: bool, comm_stream_name: str) -> None:
        self.group = group
        self.explicitly_destroy = explicitly_destroy
        self.runtime: Any = object()
        self.comm_stream = LogicalStream(comm_stream_name)
        #: every call: {"method", "stream" (current logical stream's name), ...}, for tests
        self.calls: list[dict] = []

    def destroy(self) -> None:
        check(self.explicitly_destroy, "`explicitly_destroy` flag must be set")
        self.runtime = None

    def _alive(self, name: str, info: dict) -> None:
        """Check the buffer was not destroyed and log the call."""
        check(self.runtime is not None, f"{name} on a destroyed buffer")
        self.calls.append({"method": name, "stream": current_logical_stream().name, **info})
