"""Compute/comm streams and events, on CUDA or as a CPU stand-in that records happens-before.

A :class:`StreamSet` is what the ubatch context talks to: the current stream (saved and
restored at every switch), one comm stream, and a pool of events reused across runs so that a
run can be captured in a CUDA graph. ``StreamSet.for_device`` keeps one set per device in
:data:`STREAM_POOL`, a registry with ``reset()``.

The CPU stand-in has no real concurrency. Each :class:`LogicalStream` carries a vector clock;
recording an event snapshots the clock, waiting on one merges it in. Code that touches shared
data calls :func:`record_access`; a :class:`RaceDetector` that is active on the thread reports
two accesses from different streams, at least one a write, that no event wait orders. That is
the race a missing ``wait_event`` causes on a GPU, found without one.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "LogicalStream",
    "LogicalEvent",
    "StreamSet",
    "CudaStreamSet",
    "CpuStreamSet",
    "StreamPool",
    "STREAM_POOL",
    "RaceDetector",
    "Access",
    "Race",
    "record_access",
    "current_logical_stream",
    "hand_over",
    "gpu_sleep",
    "cuda_current_stream",
    "on_cuda_stream",
]

_stream_ids = itertools.count()

# Private but long-standing torch entry points (CudaStreamSet reads them too): torch's own
# current_stream(), Event.record()/wait() without a stream and torch.cuda.stream() resolve the
# device through its generic device look-up, which asks torch.cuda.is_available() on every call.
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)

#: the Stream object of each CUDA stream key (stream id, device index, device type) seen: a
#: handful (the default, comm and link streams, a graph's capture stream); cleared past
#: _MAX_STREAM_KEYS. A Stream is only those three values, so a key reused after its stream was
#: destroyed names the new one.
_STREAM_OF_KEY: dict[tuple, torch.cuda.Stream] = {}
_MAX_STREAM_KEYS = 256


def _stream_of(key: tuple) -> torch.cuda.Stream:
    s = _STREAM_OF_KEY.get(key)
    if s is None:
        if len(_STREAM_OF_KEY) >= _MAX_STREAM_KEYS:
            _STREAM_OF_KEY.clear()
        s = _STREAM_OF_KEY[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                    device_type=key[2])
    return s


class LogicalStream:
    """A CPU stand-in for a CUDA stream: a name and a vector clock ``{stream id: count}``."""

    __slots__ = ("name", "sid", "clock")

    def __init__(self, name: str):
        self.name = name
        self.sid = next(_stream_ids)
        self.clock: dict[int, int] = {self.sid: 0}

    def wait_event(self, event: LogicalEvent) -> None:
        """Order every later operation on this stream after what ``event`` recorded."""
        for sid, count in event.clock.items():
            if self.clock.get(sid, -1) < count:
                self.clock[sid] = count

    def __repr__(self) -> str:
        return f"LogicalStream({self.name!r})"


class LogicalEvent:
    """A CPU stand-in for a CUDA event: the clock of the stream it was recorded on."""

    __slots__ = ("name", "clock")

    def __init__(self, name: str = ""):
        self.name = name
        self.clock: dict[int, int] = {}

    def record(self, stream: LogicalStream) -> None:
        # An event is a point after everything issued so far on the stream: tick so that
        # operations issued after the record are not covered by it.
        stream.clock[stream.sid] += 1
        self.clock = dict(stream.clock)


@dataclass(frozen=True)
class Access:
    """One recorded access: ``key`` read or written on ``stream`` at vector clock ``clock``."""

    key: Hashable
    write: bool
    stream: str
    sid: int
    tick: int
    clock: tuple[tuple[int, int], ...]
    label: str

    def happens_before(self, other: Access) -> bool:
        return dict(other.clock).get(self.sid, -1) >= self.tick


@dataclass(frozen=True)
class Race:
    """Two unordered accesses to one key from different streams, at least one a write."""

    first: Access
    second: Access

    def __str__(self) -> str:
        a, b = self.first, self.second
        kind = lambda x: "write" if x.write else "read"  # noqa: E731
        return (
            f"race on {a.key!r}: {kind(a)} on {a.stream} ({a.label}) and "
            f"{kind(b)} on {b.stream} ({b.label}) are not ordered by any event wait"
        )


class _CpuThreadState(threading.local):
    current: LogicalStream | None = None
    detector: RaceDetector | None = None


_cpu_tls = _CpuThreadState()


class RaceDetector:
    """Collect :func:`record_access` calls on this thread and report unordered pairs.

    Use as a context manager around code that runs on the CPU stand-in::

        with RaceDetector() as rd:
            run_ubatches(fns, device="cpu")
        assert not rd.races(), rd.report()
    """

    def __init__(self) -> None:
        self.accesses: list[Access] = []
        self._prev: RaceDetector | None = None

    def __enter__(self) -> RaceDetector:
        self._prev = _cpu_tls.detector
        _cpu_tls.detector = self
        return self

    def __exit__(self, *exc: object) -> None:
        _cpu_tls.detector = self._prev

    def races(self) -> list[Race]:
        found = []
        by_key: dict[Hashable, list[Access]] = {}
        for acc in self.accesses:
            by_key.setdefault(acc.key, []).append(acc)
        for accs in by_key.values():
            for i, a in enumerate(accs):
                for b in accs[i + 1 :]:
                    if a.sid == b.sid or not (a.write or b.write):
                        continue
                    if not (a.happens_before(b) or b.happens_before(a)):
                        found.append(Race(a, b))
        return found

    def report(self) -> str:
        return "\n".join(str(r) for r in self.races()) or "no races"


def current_logical_stream() -> LogicalStream:
    """The thread's current CPU stand-in stream (the CPU set's default stream if none was set)."""
    cur = _cpu_tls.current
    if cur is None:
        cur = STREAM_POOL.get("cpu").default_stream
        _cpu_tls.current = cur
    return cur


def record_access(key: Hashable, *, write: bool, label: str = "") -> None:
    """Record that the code now running reads (or writes) ``key`` on the current CPU stream.

    A no-op unless a :class:`RaceDetector` is active on this thread. ``key`` is any hashable
    name for the data (a string, or ``id(tensor)``).
    """
    det = _cpu_tls.detector
    if det is None:
        return
    stream = current_logical_stream()
    stream.clock[stream.sid] += 1
    det.accesses.append(
        Access(key, write, stream.name, stream.sid, stream.clock[stream.sid],
               tuple(stream.clock.items()), label)
    )


def hand_over(tensor: torch.Tensor, stream: Any) -> None:
    """Keep ``tensor``'s memory alive until the work queued so far on ``stream`` is done.

    On CUDA this is ``tensor.record_stream(stream)``; on the CPU stand-in memory is never
    reused early, so nothing is needed.
    """
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)


class StreamSet:
    """Streams and events of one device, as the ubatch context uses them.

    ``current()`` returns an opaque key for the thread's current stream, cheap to compare and
    to pass back to ``set_current``; ``key(stream)`` gives the key of a stream object.
    """

    device: torch.device
    comm_stream: Any
    default_stream: Any

    def current(self) -> Any:
        raise NotImplementedError

    def current_getter(self) -> Callable[[], Any]:
        """A fast zero-argument callable equivalent to ``current`` (used on the switch path)."""
        return self.current

    def set_current(self, key: Any) -> None:
        raise NotImplementedError

    def key(self, stream: Any) -> Any:
        raise NotImplementedError

    def stream(self, key: Any) -> Any:
        raise NotImplementedError

    def new_event(self, name: str) -> Any:
        raise NotImplementedError

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def events(self, n: int) -> list[tuple[Any, Any]]:
        """``n`` pairs ``(compute_done, comm_done)``, created once and reused across runs."""
        pairs = self._event_pairs
        while len(pairs) < n:
            i = len(pairs)
            pairs.append((self.new_event(f"ub{i}.compute_done"), self.new_event(f"ub{i}.comm_done")))
        return pairs[:n]

    def join_events(self) -> tuple[Any, Any]:
        """Events for the joins at run start (comm waits compute) and end (caller waits comm)."""
        return self._join

    def _init_events(self) -> None:
        self._event_pairs: list[tuple[Any, Any]] = []
        self._join = (self.new_event("run.start"), self.new_event("run.end"))


class CpuStreamSet(StreamSet):
    """The CPU stand-in: logical streams whose current one is kept per thread."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.default_stream = LogicalStream("compute")
        self.comm_stream = LogicalStream("comm")
        self._init_events()

    def current(self) -> LogicalStream:
        cur = _cpu_tls.current
        return cur if cur is not None else current_logical_stream()

    def current_getter(self) -> Callable[[], Any]:
        # During a run the thread's current stream is always set, so a C-level getattr
        # does (the run sets it at its start).
        current_logical_stream()
        return functools.partial(getattr, _cpu_tls, "current")

    def set_current(self, key: LogicalStream) -> None:
        _cpu_tls.current = key

    def key(self, stream: LogicalStream) -> LogicalStream:
        if not isinstance(stream, LogicalStream):
            raise TypeError(f"comm_stream on the CPU stand-in must be a LogicalStream, got {stream!r}")
        return stream

    def stream(self, key: LogicalStream) -> LogicalStream:
        return key

    def new_event(self, name: str) -> LogicalEvent:
        return LogicalEvent(name)


class CudaStreamSet(StreamSet):
    """CUDA streams of one device. The comm stream gets the highest priority, so that its
    kernels are scheduled ahead of queued compute kernels when SMs free up."""

    def __init__(self, device: torch.device):
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        lo, hi = torch.cuda.Stream.priority_range()
        self.comm_stream = torch.cuda.Stream(device=self._index, priority=hi)
        self.default_stream = torch.cuda.default_stream(self._index)
        # a tuple key is far cheaper to read, compare and restore than a torch.cuda.Stream object
        self._get = _GET_STREAM
        self._set = _SET_STREAM
        self._init_events()

    def current_getter(self) -> Callable[[], Any]:
        if self._get is not None:
            return functools.partial(self._get, self._index)
        return self.current

    def current(self) -> tuple:
        if self._get is not None:
            return self._get(self._index)
        s = torch.cuda.current_stream(self._index)
        return self.key(s)

    def set_current(self, key: tuple) -> None:
        if self._set is not None:
            self._set(stream_id=key[0], device_index=key[1], device_type=key[2])
        else:
            torch.cuda.set_stream(self.stream(key))

    def key(self, stream: torch.cuda.Stream) -> tuple:
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"comm_stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        k = (stream.stream_id, stream.device_index, stream.device_type)
        _STREAM_OF_KEY.setdefault(k, stream)
        return k

    def stream(self, key: tuple) -> torch.cuda.Stream:
        # on every switch's record and wait: the hit without a second call
        s = _STREAM_OF_KEY.get(key)
        return s if s is not None else _stream_of(key)

    def new_event(self, name: str) -> torch.cuda.Event:
        return torch.cuda.Event()


@dataclass
class StreamPool:
    """The process-wide cache of one :class:`StreamSet` per device (reused across runs)."""

    sets: dict[str, StreamSet] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, device: str | torch.device) -> StreamSet:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        name = str(dev)
        s = self.sets.get(name)
        if s is None:
            with self._lock:
                s = self.sets.get(name)
                if s is None:
                    if dev.type == "cpu":
                        s = CpuStreamSet()
                    elif dev.type == "cuda":
                        s = CudaStreamSet(dev)
                    else:
                        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
                    self.sets[name] = s
        return s

    def reset(self) -> None:
        """Forget every stream set (the next run creates fresh streams and events)."""
        with self._lock:
            self.sets.clear()
        _cpu_tls.current = None


STREAM_POOL = StreamPool()


def cuda_current_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` without torch's device look-up: the current stream's
    key read in C and one Stream object kept per key. For the per-call paths (the emulated rank's
    and the link's events and hand-overs), where CUDA is initialized already."""
    if _GET_STREAM is None or _GET_DEVICE is None:
        return torch.cuda.current_stream(device)
    if device is None:
        index = _GET_DEVICE()
    elif isinstance(device, int):
        index = device
    else:
        index = device.index if device.index is not None else _GET_DEVICE()
    return _stream_of(_GET_STREAM(index))


class on_cuda_stream:  # noqa: N801 (used as a context manager, like torch.cuda.stream)
    """``with torch.cuda.stream(stream):`` for a stream of the current device, without torch's
    device look-ups on entry and exit (a stream of another device takes torch's path, which
    also switches the current device). Not re-entrant: one object per ``with``."""

    __slots__ = ("stream", "_prev", "_ctx")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self._prev: tuple | None = None
        self._ctx: Any = None

    def __enter__(self) -> torch.cuda.Stream:
        s = self.stream
        if _SET_STREAM is None or _GET_DEVICE is None or s.device_index != _GET_DEVICE():
            self._ctx = torch.cuda.stream(s)
            self._ctx.__enter__()
            return s
        self._prev = _GET_STREAM(s.device_index)
        _SET_STREAM(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return s

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            return
        p = self._prev
        _SET_STREAM(stream_id=p[0], device_index=p[1], device_type=p[2])


#: cycles of ``torch.cuda._sleep`` per millisecond, by CUDA device index (measured once each)
_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def gpu_sleep(ms: float) -> None:
    """Queue a kernel that spins about ``ms`` milliseconds on the current CUDA stream (one block:
    it holds next to nothing of the GPU). The rate is measured once per device, at the first call
    there (a host sync)."""
    idx = torch.cuda.current_device()
    rate = _SLEEP_CYCLES_PER_MS.get(idx)
    if rate is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # wake the clocks up
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rate = _SLEEP_CYCLES_PER_MS[idx] = 20_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(max(int(ms * rate), 1))
