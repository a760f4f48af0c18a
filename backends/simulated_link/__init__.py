"""A slower link, simulated around any backend: what dispatch and combine cost across hosts.

Across hosts, an expert-parallel all-to-all crosses a network link of about 25-50 GB/s per GPU,
not NVLink's hundreds. :class:`SimulatedLinkPrepareAndFinalize` wraps a real backend: every
dispatch and combine still moves its bytes through that backend, and then the receiving side
may not read them before the link model says they arrived. Each call is one *flow*:

* ready at the point on the caller's stream where ``prepare_async`` / ``finalize_async`` is
  called (the data to send is ready there; on the CPU stand-in: the host's clock then);
* ``bytes``: what the wrapped backend moves out of one rank for this call, from the call's shape
  under uniform routing (:meth:`SimulatedLink.expected_bytes`; read on the host, no device sync):
  ``copy_engine`` and ``naive`` send every token to every peer, ``deepep_ll`` one copy per
  (token, remote expert), the others one copy per (token, remote rank that holds one of its
  experts), times ``remote_fraction``, the share that would leave the host (with 8 GPUs a host
  and 32 ranks, 7/8);
* a fixed cost per call, ``latency_us`` for a dispatch and ``combine_latency_us`` for a combine.

How the link serves its flows is ``order``:

* ``"nic"`` (default): as a NIC does (:mod:`dbo.backends.simulated_link.nic`): a flow starts
  when its data is ready on the GPU, whatever the host's order; the flows sending at once share
  the rate; the fixed cost is a latency that flows pay at the same time::

      arrival = (its bytes served by processor sharing from when it is ready) + fixed

* ``"host"``: one queue in the host's order, each call given the full rate in turn (how the
  link was modelled before; kept to reproduce figures taken with it)::

      arrival >= send + latency_us + remote_fraction * bytes / gbps, in host order

:data:`~dbo.backends.simulated_link.presets.PRESETS` holds links calibrated from DeepEP's
published internode figures (``deepep-ib``). On CUDA the waits cost the host nothing: they are
GPU kernels of one warp on link streams of their own, timed by the GPU's global timer (so that a
busy GPU's lower clock does not stretch them), behind an event recorded at the send; the
receiver makes its stream wait for the flow's arrival before the backend's own receive, so recv
hooks, events and DBO's yields work as they do without the model, and a step can be captured in
a CUDA graph. On the CPU stand-in the receiver waits on the host. What a real network adds that
this does not model: congestion and incast across ranks, message-size effects past the fixed
cost, and the SMs that RDMA proxies (DeepEP's internode kernels) take from compute.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dbo.moe.base import ActivationFormat, PrepareAndFinalize
from dbo.ubatch.streams import cuda_current_stream, gpu_sleep

from ..fp8 import FP8_DISPATCH_BYTES
from . import wall_wait as _wall_wait
from .nic import NIC_GPU, NicHost
from .presets import PRESETS

__all__ = ["SimulatedLink", "SimulatedLinkPrepareAndFinalize", "FORMULA", "NIC_FORMULA", "ORDERS",
           "LinkStreams", "LINK_STREAMS", "link_wait", "wait_clock"]

FORMULA = "arrival >= send + latency_us + remote_fraction * bytes / gbps"
#: the NIC-like order's formula
NIC_FORMULA = ("arrival = ready + (remote_fraction * bytes served by processor sharing among the flows "
               "in flight at gbps) + fixed (latency_us dispatch, combine_latency_us combine)")
#: how a link serves its flows
ORDERS = ("nic", "host")
#: calls whose modelled time a wrapper keeps (SimulatedLinkPrepareAndFinalize.modelled_us)
MODELLED_KEPT = 4096

#: backends that send every token to every peer (dispatch), and a partial sum back (combine)
_EVERY_PEER = ("copy_engine", "naive")
#: backends that send one copy per (token, remote expert)
_PER_EXPERT = ("deepep_ll",)


@dataclass(frozen=True)
class SimulatedLink:
    """A link model: ``gbps`` GB/s (1e9 bytes) out of each GPU, a fixed cost per call
    (``latency_us`` for a dispatch, ``combine_latency_us`` for a combine: the same when None),
    ``remote_fraction`` of the traffic crossing it (the rest stays on the host, at no cost), its
    flows served in ``order`` (``"nic"``: when ready, sharing the rate; ``"host"``: one queue in
    the host's order). ``name`` is the preset it came from, if any."""

    gbps: float
    latency_us: float = 0.0
    remote_fraction: float = 1.0
    combine_latency_us: float | None = None
    order: str = "nic"
    name: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.gbps, (int, float)) and self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"gbps must be a positive number, got {self.gbps!r}")
        for what in ("latency_us", "combine_latency_us"):
            v = getattr(self, what)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{what} must be >= 0, got {v!r}")
        if not (isinstance(self.remote_fraction, (int, float)) and 0 <= self.remote_fraction <= 1):
            raise ValueError(f"remote_fraction must be in [0, 1], got {self.remote_fraction!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")

    @classmethod
    def parse(cls, text: str, remote_fraction: float = 1.0, order: str = "nic") -> SimulatedLink:
        """A preset name (``"deepep-ib"``, see :data:`PRESETS`) or ``"GBPS[,LATENCY_US[,COMBINE_US]]"``
        (the benchmark's ``--link``), e.g. ``"50,5"``."""
        name = str(text).strip()
        if name in PRESETS:
            gbps, dispatch_us, combine_us = PRESETS[name]
            return cls(gbps, dispatch_us, remote_fraction, combine_us, order, name)
        parts = [p.strip() for p in name.split(",")]
        if not 1 <= len(parts) <= 3 or not all(parts):
            raise ValueError(f"a link is a preset ({', '.join(sorted(PRESETS))}) or "
                             f"GBPS[,LATENCY_US[,COMBINE_LATENCY_US]], got {text!r}")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"a link is a preset ({', '.join(sorted(PRESETS))}) or "
                             f"GBPS[,LATENCY_US[,COMBINE_LATENCY_US]] (numbers), got {text!r}") from None
        return cls(nums[0], nums[1] if len(nums) > 1 else 0.0, remote_fraction,
                   nums[2] if len(nums) > 2 else None, order)

    def fixed_us(self, phase: str) -> float:
        """The fixed cost of one call of ``phase`` (``"dispatch"``, ``"combine"``, ...): us."""
        if phase.startswith("combine") and self.combine_latency_us is not None:
            return self.combine_latency_us
        return self.latency_us

    def transfer_us(self, nbytes: float, phase: str = "dispatch") -> float:
        """The modelled time of one transfer of ``nbytes`` out of a rank alone on the link: us."""
        return self.fixed_us(phase) + self.remote_fraction * nbytes / (self.gbps * 1e3)

    @staticmethod
    def expected_bytes(backend: str, *, tokens: int, topk: int, world_size: int, num_experts: int,
                       hidden: int, elem_bytes: float) -> float:
        """Bytes one dispatch (or combine) of ``tokens`` rows moves out of a rank under uniform
        top-``topk`` routing over ``num_experts`` experts on ``world_size`` ranks."""
        if world_size <= 1 or tokens <= 0:
            return 0.0
        row = hidden * elem_bytes
        peers = world_size - 1
        if backend in _EVERY_PEER:
            return float(tokens * peers * row)
        if backend in _PER_EXPERT:
            return tokens * topk * peers / world_size * row
        # P(a token has at least one of its experts on a given other rank)
        local = num_experts // world_size
        k = min(topk, num_experts)
        miss = math.comb(num_experts - local, k) / math.comb(num_experts, k) if k else 1.0
        return tokens * peers * (1.0 - miss) * row

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "formula": FORMULA if self.order == "host" else NIC_FORMULA,
                "wait_clock": wait_clock()}

    def describe(self) -> str:
        fixed = (f"{self.latency_us:g} us fixed" if self.combine_latency_us is None else
                 f"{self.latency_us:g} us dispatch / {self.combine_latency_us:g} us combine fixed")
        how = ("served as a NIC serves flows: each when its data is ready, sharing the rate"
               if self.order == "nic" else "served in the host's order, each call at the full rate")
        return (f"simulated link{' ' + self.name if self.name else ''}: {self.gbps:g} GB/s, {fixed}, "
                f"{self.remote_fraction:.3f} of the traffic remote, {how} (waits timed by the GPU's "
                f"{wait_clock()})")


def wait_clock() -> str:
    """What times the modelled waits on CUDA here: the GPU's global timer where Triton is there,
    else SM clock cycles (``torch.cuda._sleep``, calibrated once on an idle GPU: it runs long
    when the clock drops under load). ``DBO_LINK_WAIT_CLOCK=cycles`` picks the cycles (to
    reproduce figures taken with them)."""
    if os.environ.get("DBO_LINK_WAIT_CLOCK", "") == "cycles" or not _wall_wait.AVAILABLE:
        return "SM cycles"
    return "global timer"


def link_wait(us: float) -> None:
    """Queue the modelled wait of ``us`` microseconds on the current CUDA stream."""
    if wait_clock() == "global timer":
        _wall_wait.wait_wall_ns(round(us * 1e3))
    else:
        gpu_sleep(us / 1e3)


class LinkStreams:
    """One link stream per CUDA device, made once (a run may be captured in a CUDA graph). One
    process-wide object, :data:`LINK_STREAMS`."""

    def __init__(self) -> None:
        self.streams: dict[int, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self.streams:
            with torch.cuda.device(idx):
                self.streams[idx] = torch.cuda.Stream(priority=-1)
        return self.streams[idx]

    def reset(self) -> None:
        """Forget the streams (with nothing queued on them)."""
        self.streams.clear()


LINK_STREAMS = LinkStreams()


class LinkServer:
    """Serves one :class:`SimulatedLink`'s flows: :meth:`start` marks where a flow's data is
    ready, :meth:`hold` queues the flow and returns what its receiver calls first (a stream
    wait on CUDA, a host sleep on the CPU stand-in). Used by the link wrapper and by the
    emulated rank (:mod:`dbo.backends.emulated`)."""

    def __init__(self, link: SimulatedLink):
        self.link = link
        self._host = NicHost()

    @staticmethod
    def start(device: torch.device) -> Any:
        """Where the data of a flow is ready: an event on the current CUDA stream, or the host's
        clock (seconds)."""
        if device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(cuda_current_stream(device))
            return ev
        return time.perf_counter()

    def hold(self, start: Any, device: torch.device, phase: str, *, nbytes: float = 0.0,
             count: torch.Tensor | None = None, bytes_per_count: float = 0.0,
             fixed_us: float | None = None, begun: torch.Tensor | None = None) -> Callable[[], None]:
        """Queue a flow of ``phase`` ready at ``start`` with ``nbytes`` remote bytes, or
        ``count * bytes_per_count`` with ``count`` a one-element int64 tensor counted on the
        device (kept from reuse until the flow has read it), and the phase's fixed cost (or
        ``fixed_us``). ``begun``: where the call stamped the GPU's global timer when it began
        (:meth:`NicGpu.flow`); the NIC-like link counts the fixed cost from there. Returns the
        receiver's wait."""
        link = self.link
        fixed = link.fixed_us(phase) if fixed_us is None else fixed_us
        if count is not None and device.type != "cuda":
            nbytes, count = float(count.item()) * bytes_per_count, None
        if device.type == "cuda":
            if _wall_wait.AVAILABLE:
                done = NIC_GPU.flow(device, start, gbps=link.gbps, fixed_us=fixed, nbytes=nbytes,
                                    count=count, bytes_per_count=bytes_per_count,
                                    begun=None if link.order == "host" else begun,
                                    host_order=link.order == "host")
            elif link.order == "host" and count is None:  # SM cycles, on the host-order link stream
                stream = LINK_STREAMS.get(device)
                stream.wait_event(start)
                with torch.cuda.stream(stream):  # no yield inside
                    link_wait(fixed + nbytes / (link.gbps * 1e3))
                    done = torch.cuda.Event()
                    done.record()
            else:
                raise RuntimeError("this link needs Triton on CUDA (the NIC-like order, or bytes "
                                   "counted on the device); use --link-order host without it")

            def wait() -> None:
                cuda_current_stream(device).wait_event(done)
            return wait

        if link.order == "host":
            arrival_us = start * 1e6 + fixed + nbytes / (link.gbps * 1e3)
        else:
            arrival_us = self._host.arrival(nbytes, fixed, link.gbps, ready_us=start * 1e6)
        return lambda: self._host.wait(arrival_us)


class SimulatedLinkPrepareAndFinalize(PrepareAndFinalize):
    """``inner`` (any backend, async or not) with its arrivals held back to a
    :class:`SimulatedLink`'s time. Results are ``inner``'s, bit for bit.

    Args:
        inner: the backend that moves the bytes.
        link: the model.
        backend: ``inner``'s registry name (``"deepep_ht"``, ...), which sets how many bytes a call
            moves (see :meth:`SimulatedLink.expected_bytes`).
    """

    def __init__(self, inner: PrepareAndFinalize, link: SimulatedLink, backend: str):
        if not isinstance(inner, PrepareAndFinalize):
            raise TypeError(f"inner must be a PrepareAndFinalize, got {type(inner).__name__}")
        if not isinstance(link, SimulatedLink):
            raise TypeError(f"link must be a SimulatedLink, got {type(link).__name__}")
        self.inner, self.link, self.backend = inner, link, backend
        self.name = f"{backend}+link"
        self._world = inner.num_dispatchers()
        self._num_experts = 0  # the last dispatch's, for the combine of the same call
        self._topk = 1
        #: modelled microseconds of the last calls, (phase, us), oldest first: for tests and
        #: reports (the last MODELLED_KEPT, so that a long run does not grow it without bound)
        self.modelled_us: deque[tuple[str, float]] = deque(maxlen=MODELLED_KEPT)
        self._server = LinkServer(link)

    def __getattr__(self, attr: str) -> Any:  # the wrapped backend's own knobs (set_num_sms, ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    # ---- the contract, delegated ----------------------------------------------------------

    @property
    def activation_format(self) -> ActivationFormat:
        return self.inner.activation_format

    def topk_indices_dtype(self) -> torch.dtype | None:
        return self.inner.topk_indices_dtype()

    def max_num_tokens_per_rank(self) -> int | None:
        return self.inner.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return self.inner.num_dispatchers()

    def output_is_reduced(self) -> bool:
        return self.inner.output_is_reduced()

    def supports_async(self) -> bool:
        return True

    def reset(self) -> None:
        self.inner.reset()

    def supports_expert_groups(self) -> bool:
        return self.inner.supports_expert_groups()

    # ---- the delay --------------------------------------------------------------------------

    def _flow(self, phase: str, tokens: int, topk: int, hidden: int, elem_bytes: float,
              share: float = 1.0) -> float:
        """The remote bytes of one call (``share`` of its shape's bytes), noting the call's
        modelled time alone on the link in :attr:`modelled_us`."""
        nbytes = share * self.link.remote_fraction * SimulatedLink.expected_bytes(
            self.backend, tokens=tokens, topk=topk, world_size=self._world,
            num_experts=max(self._num_experts, self._world), hidden=hidden, elem_bytes=elem_bytes)
        self.modelled_us.append((phase, self.link.fixed_us(phase) + nbytes / (self.link.gbps * 1e3)))
        return nbytes

    @staticmethod
    def _wrap(res: Any, wait: Callable[[], None]) -> Any:
        if isinstance(res, tuple):
            hook, receiver = res
        else:
            hook, receiver = None, res

        def held_receiver() -> Any:
            wait()
            return receiver()

        return held_receiver if hook is None else (hook, held_receiver)

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        self._num_experts, self._topk = num_experts, topk_ids.shape[1]
        start = self._server.start(a1.device)
        elem = FP8_DISPATCH_BYTES if getattr(self.inner, "use_fp8_dispatch", False) else a1.element_size()
        nbytes = self._flow("dispatch", a1.shape[0], topk_ids.shape[1], a1.shape[1], elem)
        if self.inner.supports_async():
            res = self.inner.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                           apply_router_weight_on_input, quant_config)
        else:
            out = self.inner.prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                     apply_router_weight_on_input, quant_config)
            res = lambda: out  # noqa: E731 - a receiver of what the sync call returned
        return self._wrap(res, self._server.hold(start, a1.device, "dispatch", nbytes=nbytes))

    def _held_combine(self, output: torch.Tensor, phase: str, share: float,
                      launch: Callable[[], Any]) -> Any:
        """``launch()``'s combine, its arrival held back for ``share`` of the bytes that come
        back over the link for ``output``'s rows (as many as their dispatch sent, on average
        over the ranks)."""
        start = self._server.start(output.device)
        nbytes = self._flow(phase, output.shape[0], self._topk, output.shape[1], output.element_size(), share)
        return self._wrap(launch(), self._server.hold(start, output.device, phase, nbytes=nbytes))

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce):
        def launch() -> Any:
            if self.inner.supports_async():
                return self.inner.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                                 apply_router_weight_on_input, weight_and_reduce)
            self.inner.finalize(output, fused_expert_output, topk_weights, topk_ids,
                                apply_router_weight_on_input, weight_and_reduce)
            return lambda: None

        return self._held_combine(output, "combine", 1.0, launch)

    def finalize_group_async(self, output, fused_expert_output, topk_weights, topk_ids,
                             apply_router_weight_on_input, weight_and_reduce, *, experts, last):
        """One expert group's combine (the ``sbo`` schedule), held back for the group's share
        of the combine's bytes (a backend that sends a row per token and expert: the group's
        experts' share of the local experts) plus the link's latency, once per group."""
        n_local = max(max(self._num_experts, self._world) // self._world, 1)
        return self._held_combine(output, "combine_group", (experts[1] - experts[0]) / n_local,
                                  lambda: self.inner.finalize_group_async(
                                      output, fused_expert_output, topk_weights, topk_ids,
                                      apply_router_weight_on_input, weight_and_reduce,
                                      experts=experts, last=last))
