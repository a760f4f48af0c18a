"""A link that serves flows as a NIC does, on the GPU and on the CPU stand-in.

A NIC sends a transfer (a *flow*) as soon as its data is ready, whatever order the host queued
it in; the flows in flight at once share its rate equally (processor sharing), so two flows of
``b`` bytes that start together both end at ``2 b / rate``, and the link's busy time is the sum
of its flows' bytes at the rate. After its bytes, a flow pays a fixed cost (signalling, the
receiver's polling and grid syncs: DeepEP's per-call cost, about 30-60 us across hosts), which
is a latency: two flows pay theirs at the same time. So a flow ready at ``t0`` arrives at::

    arrival = (the time processor sharing has served its bytes, from t0) + fixed_us

On the GPU a call may stamp when it began (its first kernel's start, before the flow's data is
ready): the fixed cost then counts from that stamp, so the call's own work before the flow (the
emulated rank's routing, cast and packing) is part of it, as DeepEP's own kernels are part of its
published per-call times; the arrival is the served bytes plus what is left of the fixed cost.

:func:`serve` is that model in plain Python, the reference the tests hold both runtimes to:

* :class:`NicGpu` queues each flow as one warp of a GPU kernel on a stream of its own (a pool
  of high-priority streams), behind an event recorded where the data became ready, so a flow
  starts when the GPU reaches that point, not in host order. The flows of one device share a
  small state in device memory (how many flows are sending, and the bytes each has been served
  so far, advanced under a lock from the GPU's global timer): nothing on the host, so a step
  that uses it can be captured in a CUDA graph and replayed. The byte count may be read from
  device memory, where the sender counted it from the routing it holds.
* :class:`NicHost` serves the CPU stand-in: CPU tensors are ready when the host queues them, so
  a flow is ready at the host's clock then, and its receiver sleeps until :func:`serve` says it
  arrived, counting every flow registered so far.

Both count time in microseconds and rates in GB/s (1e9 bytes per second, i.e. 1e3 bytes per
microsecond).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dbo.ubatch.streams import on_cuda_stream

from . import wall_wait

__all__ = ["Flow", "serve", "NicHost", "NicGpu", "NIC_GPU", "NIC_STREAMS"]

#: link streams per device: flows on one stream start in the order they were queued there
NIC_STREAMS = 8


@dataclass(frozen=True)
class Flow:
    """One transfer: ready at ``ready_us``, ``nbytes`` to send, then ``fixed_us`` of latency."""

    ready_us: float
    nbytes: float
    fixed_us: float = 0.0


def serve(flows: Sequence[Flow], gbps: float) -> list[float]:
    """The arrival time (us) of each flow on a link of ``gbps`` GB/s shared equally by the flows
    sending at once (processor sharing), each flow paying its ``fixed_us`` after its bytes."""
    if gbps <= 0:
        raise ValueError(f"gbps must be positive, got {gbps}")
    rate = gbps * 1e3  # bytes per microsecond
    n = len(flows)
    done = [0.0] * n
    left = [max(float(f.nbytes), 0.0) for f in flows]
    order = sorted(range(n), key=lambda i: flows[i].ready_us)
    active: list[int] = []
    t = flows[order[0]].ready_us if n else 0.0
    nxt = 0
    while nxt < n or active:
        while nxt < n and flows[order[nxt]].ready_us <= t:
            i = order[nxt]
            nxt += 1
            if left[i] <= 0:
                done[i] = flows[i].ready_us
            else:
                active.append(i)
        if not active:
            if nxt >= n:
                break
            t = flows[order[nxt]].ready_us
            continue
        share = rate / len(active)
        first = min(active, key=lambda i: left[i])
        first_end = t + left[first] / share
        next_ready = flows[order[nxt]].ready_us if nxt < n else float("inf")
        ends = first_end <= next_ready
        t_next = first_end if ends else next_ready
        for i in active:
            left[i] -= (t_next - t) * share
        t = t_next
        if ends:
            left[first] = 0.0  # exactly, whatever the rounding of the clock
        still = []
        for i in active:
            if left[i] <= 1e-9 * max(flows[i].nbytes, 1.0):
                done[i] = t
            else:
                still.append(i)
        active = still
    return [done[i] + flows[i].fixed_us for i in range(n)]


class NicHost:
    """The CPU stand-in's link: :meth:`arrival` of a flow ready now, counting the flows before
    it. One object per link; the flows of the last ``keep`` calls are kept (older ones have
    arrived long before any new flow is ready)."""

    def __init__(self, keep: int = 64):
        self._flows: list[Flow] = []
        self._keep = keep
        self._lock = threading.Lock()

    def arrival(self, nbytes: float, fixed_us: float, gbps: float, ready_us: float | None = None) -> float:
        """Register a flow ready at ``ready_us`` (default: now, on ``time.perf_counter``'s clock in
        us); returns its arrival time (us) among the flows registered so far."""
        now = time.perf_counter() * 1e6 if ready_us is None else ready_us
        with self._lock:
            self._flows.append(Flow(now, nbytes, fixed_us))
            del self._flows[:-self._keep]
            return serve(self._flows, gbps)[-1]

    def wait(self, arrival_us: float) -> None:
        """Sleep until ``arrival_us`` (``time.perf_counter``'s clock, us)."""
        left = arrival_us * 1e-6 - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def reset(self) -> None:
        with self._lock:
            self._flows.clear()


class NicGpu:
    """The GPU link of each device: its flows' shared state and its pool of link streams. One
    process-wide object, :data:`NIC_GPU`, with ``reset()``.

    A flow is queued with :meth:`flow`; it needs Triton (:data:`wall_wait.AVAILABLE`)."""

    def __init__(self) -> None:
        self._state: dict[int, torch.Tensor] = {}
        self._one: dict[int, torch.Tensor] = {}
        self._zero: dict[int, torch.Tensor] = {}
        self._streams: dict[int, list[torch.cuda.Stream]] = {}
        self._next: dict[int, int] = {}

    def _index(self, device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def _setup(self, idx: int) -> None:
        if idx in self._state:
            return
        with torch.cuda.device(idx):
            # [lock, flows sending, last update (ns), bytes served per flow (x 1024)]; the second
            # row is the host-order queue's (its flows never overlap: one stream)
            self._state[idx] = torch.zeros(2, 4, dtype=torch.int64, device=f"cuda:{idx}")
            self._one[idx] = torch.ones(1, dtype=torch.int64, device=f"cuda:{idx}")
            self._zero[idx] = torch.zeros(1, dtype=torch.int64, device=f"cuda:{idx}")
            # the last stream is the host-order queue's
            self._streams[idx] = [torch.cuda.Stream(priority=-1) for _ in range(NIC_STREAMS + 1)]
            self._next[idx] = 0

    def flow(self, device: torch.device, ready: torch.cuda.Event, *, gbps: float, fixed_us: float,
             nbytes: float = 0.0, count: torch.Tensor | None = None,
             bytes_per_count: float = 0.0, begun: torch.Tensor | None = None,
             host_order: bool = False) -> torch.cuda.Event:
        """Queue one flow that is ready when ``ready`` completes; returns the event of its arrival.

        Its bytes are ``nbytes`` (known on the host), or ``count * bytes_per_count`` with
        ``count`` a one-element int64 tensor on the device (counted there, read when the flow
        starts; its memory is kept from reuse until the flow has read it).
        ``begun``: a one-element int64 tensor on the device where the call stamped the global
        timer (ns) when it began: the fixed cost counts from there (the call's own work before
        the flow is part of it), as DeepEP's figures count a call from its kernels' start.
        ``host_order``: queue it behind the flows queued before it in this mode instead (one
        queue in the host's order, each flow at the full rate in turn).
        """
        idx = self._index(device)
        self._setup(idx)
        streams = self._streams[idx]
        if host_order:
            stream, state = streams[-1], self._state[idx][1]
        else:
            stream, state = streams[self._next[idx]], self._state[idx][0]
            self._next[idx] = (self._next[idx] + 1) % NIC_STREAMS
        if count is None:
            count_t, unit = self._one[idx], nbytes
        else:
            count_t, unit = count, bytes_per_count
            # the flow reads the count on the link stream, later than its maker's stream may
            # free and reuse its memory: a reused count is a garbage byte count, a flow that
            # never ends
            count.record_stream(stream)
        if begun is None:
            begun = self._zero[idx]
        else:
            begun.record_stream(stream)
        stream.wait_event(ready)
        with on_cuda_stream(stream):  # no yield inside
            wall_wait.nic_flow(state, count_t, begun, unit_q=round(unit * 1024),
                               rate_q=round(gbps * 1024), fixed_ns=round(fixed_us * 1e3))
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def reset(self) -> None:
        """Forget the states and streams (with no flow in flight)."""
        self._state.clear()
        self._one.clear()
        self._zero.clear()
        self._streams.clear()
        self._next.clear()


NIC_GPU = NicGpu()
