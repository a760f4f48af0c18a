"""A slower link, simulated around any backend: what dispatch and combine cost across hosts.

Across hosts, an expert-parallel all-to-all crosses a network link of about 25-50 GB/s per GPU,
not NVLink's hundreds. :class:`SimulatedLinkPrepareAndFinalize` wraps a real backend: every
dispatch and combine still moves its bytes through that backend, and then the receiving side
may not read them before the modelled time has passed since the send was queued::

    arrival >= send + latency_us + remote_fraction * bytes / gbps

* ``send``: when the data to send is ready, i.e. the point on the caller's stream at which
  ``prepare_async`` / ``finalize_async`` is called (on the CPU stand-in: the host's clock then);
* ``bytes``: what the wrapped backend moves out of one rank for this call, from the call's shape
  under uniform routing (:meth:`SimulatedLink.expected_bytes`; read on the host, no device sync):
  ``copy_engine`` and ``naive`` send every token to every peer, ``deepep_ll`` one copy per
  (token, remote expert), the others one copy per (token, remote rank that holds one of its
  experts);
* ``remote_fraction``: the share of that traffic that would leave the host (with 8 GPUs a host
  and 32 ranks, 7/8); ``latency_us``: one message's latency.

On CUDA the wait costs the host nothing: after the backend has queued its transfer, a GPU wait
of the modelled time (one warp reading the GPU's global timer, so that a busy GPU's lower clock
does not stretch it) is queued on a link stream of its own, behind an event recorded at the
send; the receiver makes its stream wait for the end of that sleep before the backend's own
receive, so recv hooks, events and DBO's yields work as they do without the model. On the CPU
stand-in the receiver waits on the host until the modelled time has passed. What a real network
adds that this does not model: congestion and incast, message-size effects past a single
latency, and the SMs that RDMA proxies (DeepEP's internode kernels) take from compute.
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
from dbo.ubatch.streams import gpu_sleep

from ..fp8 import FP8_DISPATCH_BYTES
from . import wall_wait as _wall_wait

__all__ = ["SimulatedLink", "SimulatedLinkPrepareAndFinalize", "FORMULA", "LinkStreams", "LINK_STREAMS",
           "link_wait", "wait_clock"]

FORMULA = "arrival >= send + latency_us + remote_fraction * bytes / gbps"
#: calls whose modelled time a wrapper keeps (SimulatedLinkPrepareAndFinalize.modelled_us)
MODELLED_KEPT = 4096

#: backends that send every token to every peer (dispatch), and a partial sum back (combine)
_EVERY_PEER = ("copy_engine", "naive")
#: backends that send one copy per (token, remote expert)
_PER_EXPERT = ("deepep_ll",)


@dataclass(frozen=True)
class SimulatedLink:
    """A link model: ``gbps`` GB/s (1e9 bytes) out of each GPU, ``latency_us`` per transfer,
    ``remote_fraction`` of the traffic crossing it (the rest stays on the host, at no cost)."""

    gbps: float
    latency_us: float = 0.0
    remote_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.gbps, (int, float)) and self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"gbps must be a positive number, got {self.gbps!r}")
        if not (isinstance(self.latency_us, (int, float)) and self.latency_us >= 0):
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us!r}")
        if not (isinstance(self.remote_fraction, (int, float)) and 0 <= self.remote_fraction <= 1):
            raise ValueError(f"remote_fraction must be in [0, 1], got {self.remote_fraction!r}")

    @classmethod
    def parse(cls, text: str, remote_fraction: float = 1.0) -> SimulatedLink:
        """``"GBPS[,LATENCY_US]"`` (the benchmark's ``--link``), e.g. ``"50,5"``."""
        parts = [p.strip() for p in str(text).split(",")]
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"a link is GBPS[,LATENCY_US], got {text!r}")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"a link is GBPS[,LATENCY_US] (numbers), got {text!r}") from None
        return cls(nums[0], nums[1] if len(nums) > 1 else 0.0, remote_fraction)

    def transfer_us(self, nbytes: float) -> float:
        """The modelled time of one transfer of ``nbytes`` out of a rank: microseconds."""
        return self.latency_us + self.remote_fraction * nbytes / (self.gbps * 1e3)

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
        return {**asdict(self), "formula": FORMULA, "wait_clock": wait_clock()}

    def describe(self) -> str:
        return (f"simulated link: {self.gbps:g} GB/s, {self.latency_us:g} us latency, "
                f"{self.remote_fraction:.3f} of the traffic remote ({FORMULA}; bytes from each call's "
                f"shape under uniform routing; waits timed by the GPU's {wait_clock()})")


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

    def _us(self, phase: str, tokens: int, topk: int, hidden: int, elem_bytes: float,
            share: float = 1.0) -> float:
        nbytes = SimulatedLink.expected_bytes(self.backend, tokens=tokens, topk=topk,
                                              world_size=self._world,
                                              num_experts=max(self._num_experts, self._world),
                                              hidden=hidden, elem_bytes=elem_bytes)
        us = self.link.transfer_us(share * nbytes)
        self.modelled_us.append((phase, us))
        return us

    def _start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            return ev
        return time.perf_counter()

    def _held(self, start: Any, us: float, device: torch.device) -> Callable[[], None]:
        """Queue the modelled delay after ``start``; returns what the receiver calls first."""
        if device.type == "cuda":
            stream = LINK_STREAMS.get(device)
            stream.wait_event(start)
            with torch.cuda.stream(stream):  # no yield inside
                link_wait(us)
                done = torch.cuda.Event()
                done.record()

            def wait() -> None:
                torch.cuda.current_stream().wait_event(done)
            return wait

        def wait_host() -> None:
            left = start + us * 1e-6 - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return wait_host

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
        start = self._start(a1.device)
        elem = FP8_DISPATCH_BYTES if getattr(self.inner, "use_fp8_dispatch", False) else a1.element_size()
        us = self._us("dispatch", a1.shape[0], topk_ids.shape[1], a1.shape[1], elem)
        if self.inner.supports_async():
            res = self.inner.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                           apply_router_weight_on_input, quant_config)
        else:
            out = self.inner.prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                     apply_router_weight_on_input, quant_config)
            res = lambda: out  # noqa: E731 - a receiver of what the sync call returned
        return self._wrap(res, self._held(start, us, a1.device))

    def _held_combine(self, output: torch.Tensor, phase: str, share: float,
                      launch: Callable[[], Any]) -> Any:
        """``launch()``'s combine, its arrival held back for ``share`` of the bytes that come
        back over the link for ``output``'s rows (as many as their dispatch sent, on average
        over the ranks)."""
        start = self._start(output.device)
        us = self._us(phase, output.shape[0], self._topk, output.shape[1], output.element_size(), share)
        return self._wrap(launch(), self._held(start, us, output.device))

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
