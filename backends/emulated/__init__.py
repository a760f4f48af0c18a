"""One device as rank ``r`` of an expert-parallel group of ``N`` ranks, with no process group.

A real deployment across hosts (DeepSeek-V3 on 32-256 GPUs, 8 a host) cannot be measured on one
GPU, and a group of 2-4 GPUs on one host has the wrong numbers of local experts and the wrong
share of traffic leaving the host. The ``emulated`` backend makes one device do what rank ``r``'s
GPU does in such a deployment: it keeps the ``E / N`` experts of rank ``r``, and dbo's real
DeepEP backends (:mod:`dbo.backends.deepep_ll`, :mod:`dbo.backends.deepep_ht`) run over
:class:`~dbo.backends.emulated.buffer.EmulatedBuffer`, which moves the bytes that rank sends and
receives on this device's memory and holds each arrival back by a link
(:class:`~dbo.backends.simulated_link.SimulatedLink`, served as a NIC serves flows). See the
buffer's docstring for what the rank receives (its own tokens stand in for the peers') and for
what is not modelled.

Build it like any backend::

    pf = make_backend("emulated", None, hidden=7168, num_experts=256, topk=8,
                      dtype=torch.bfloat16, device="cuda", max_tokens_per_rank=256,
                      ep_size=64, layout="deepep_ll", link=SimulatedLink.parse("deepep-ib"))

``pf.num_dispatchers()`` is ``ep_size``, so the model keeps ``num_experts / ep_size`` local
experts; a token's top-k over the ``num_experts`` global experts decides which of its pairs
leave the rank. The layer's output equals a single-process MoE over the local experts with the
ids :func:`dbo.moe.validate.stand_in_local_ids` gives.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dbo.backends.deepep.buffer import (
    BufferMode,
    BufferRequest,
    DeepEPApi,
    DeepEPBufferCache,
    round_up_hidden,
)
from dbo.backends.deepep.common import DeepEPPrepareAndFinalize
from dbo.backends.deepep_ht import DeepEPHTPrepareAndFinalize
from dbo.backends.deepep_ll import DeepEPLLPrepareAndFinalize, low_latency_hidden, low_latency_max_tokens
from dbo.backends.simulated_link import SimulatedLink

from .buffer import EmulatedBuffer, EmulatedGroup

__all__ = ["LAYOUTS", "EmulatedDeployments", "EMULATED", "EmulatedBuffer", "EmulatedGroup",
           "make_prepare_finalize"]

#: the layouts an emulated rank moves its bytes in: the DeepEP backend that runs on it
LAYOUTS = ("deepep_ll", "deepep_ht")


class EmulatedDeployments:
    """The emulated groups and their buffers, one per (group size, rank, hosts, device, link):
    every layer of a model built for one deployment shares one buffer, as every layer on a real
    rank shares DeepEP's. One process-wide object, :data:`EMULATED`, with ``reset()``."""

    def __init__(self) -> None:
        self.groups: dict[tuple, EmulatedGroup] = {}
        self.buffers = DeepEPBufferCache()

    def group(self, key: tuple, size: int, rank: int, gpus_per_host: int) -> EmulatedGroup:
        if key not in self.groups:
            self.groups[key] = EmulatedGroup(size, rank, gpus_per_host)
        return self.groups[key]

    def reset(self) -> None:
        """Free every emulated buffer and forget the groups."""
        self.buffers.reset()
        self.groups.clear()


EMULATED = EmulatedDeployments()


def _api(device: torch.device, link: SimulatedLink | None, remote_fraction: float | None,
         imbalance: float) -> DeepEPApi:
    class Buffer(EmulatedBuffer):
        def __init__(self, group: Any, *args: Any, **kwargs: Any):
            super().__init__(group, *args, device=device, link=link, remote_fraction=remote_fraction,
                             imbalance=imbalance, **kwargs)

    return DeepEPApi(module=None, version="emulated", buffer_cls=Buffer, v2_cls=None)  # type: ignore[arg-type]


def make_prepare_finalize(
    group: Any,
    *,
    hidden: int,
    max_tokens_per_rank: int | None,
    num_experts: int,
    topk: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    ep_size: int = 16,
    rank: int = 0,
    layout: str = "deepep_ll",
    link: SimulatedLink | None = None,
    gpus_per_host: int = 8,
    remote_fraction: float | None = None,
    imbalance: float = 1.0,
    use_fp8_dispatch: bool = False,
    dequantize_received: bool = True,
    timeout_s: float = 60.0,
) -> DeepEPPrepareAndFinalize:
    """Rank ``rank`` of an ``ep_size``-rank group on ``device``, moving its bytes in ``layout``.

    Args:
        group: unused (an emulated rank has no peers); any process group or None.
        hidden, num_experts, topk, dtype: the layer's shape (bf16: DeepEP's kernels are).
        max_tokens_per_rank: the most tokens in one call (the low-latency slabs' size).
        ep_size: the group size ``N`` (>= 2); ``num_experts`` must be a multiple of it.
        rank: the rank played.
        layout: ``"deepep_ll"`` (low-latency slabs, hooks, no host wait) or ``"deepep_ht"``
            (normal mode: rows, a host wait for the received counts per dispatch).
        link: the link the bytes leaving the host cross (None: they arrive at once).
        gpus_per_host: ranks per host; bytes to ranks of other hosts cross the link.
        remote_fraction: instead, this share of the bytes to every other rank crosses it (to
            stand for a group that fits one host, as the link model on real groups does).
        imbalance: the rank played is the hottest one after load balancing: it receives this
            many times a rank's mean rows (max / mean, >= 1; the deepep_ll layout). The extra
            rows cross the link, are computed by its experts and go back; its own tokens'
            output is unchanged.
        use_fp8_dispatch, dequantize_received, timeout_s: as for the DeepEP backend of ``layout``.

    Raises:
        ValueError: a bad layout, group size, rank or share; a shape the layout refuses.
        TypeError: a non-bf16 dtype, a link that is not a :class:`SimulatedLink`.
    """
    del group
    if layout not in LAYOUTS:
        raise ValueError(f"emulated: layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype != torch.bfloat16:
        raise TypeError(f"emulated: the {layout} layout moves bf16 activations, got dtype={dtype}")
    if link is not None and not isinstance(link, SimulatedLink):
        raise TypeError(f"emulated: link must be a SimulatedLink, got {type(link).__name__}")
    if remote_fraction is not None and not 0.0 <= remote_fraction <= 1.0:
        raise ValueError(f"emulated: remote_fraction must be in [0, 1], got {remote_fraction!r}")
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not imbalance >= 1.0:
        raise ValueError(f"emulated: imbalance must be a number >= 1 (max / mean rows), got {imbalance!r}")
    if imbalance != 1.0 and layout != "deepep_ll":
        raise ValueError(f"emulated: imbalance is modelled for the deepep_ll layout, not {layout}")
    if not isinstance(ep_size, int) or ep_size < 2 or num_experts % ep_size:
        raise ValueError(f"emulated: ep_size must be an int >= 2 that divides num_experts={num_experts}, "
                         f"got {ep_size!r}")
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (ep_size, rank, gpus_per_host, str(dev), link, remote_fraction, float(imbalance))
    grp = EMULATED.group(key, ep_size, rank, gpus_per_host)
    api = _api(dev, link, remote_fraction, float(imbalance))
    if layout == "deepep_ll":
        if max_tokens_per_rank is None:
            raise ValueError("emulated: the deepep_ll layout needs max_tokens_per_rank")
        # a hot rank's extra pairs repeat its own at most ceil(imbalance) times over: its slabs
        # hold that many times a rank's (a real one's peers send it that many more tokens)
        max_tokens_per_rank *= math.ceil(imbalance)
        req = BufferRequest(BufferMode.LOW_LATENCY, low_latency_hidden(hidden),
                            low_latency_max_tokens(max_tokens_per_rank, ep_size), num_experts, topk,
                            use_fp8_dispatch)
        pf: DeepEPPrepareAndFinalize = DeepEPLLPrepareAndFinalize(
            EMULATED.buffers.get(grp, req, api), num_experts=num_experts, hidden=hidden,
            max_tokens_per_rank=max_tokens_per_rank, use_fp8_dispatch=use_fp8_dispatch,
            dequantize_received=dequantize_received, timeout_s=timeout_s)
    else:
        padded = round_up_hidden(hidden, torch.float8_e4m3fn if use_fp8_dispatch else torch.bfloat16)
        req = BufferRequest(BufferMode.HIGH_THROUGHPUT, padded, 1, num_experts, topk, use_fp8_dispatch)
        pf = DeepEPHTPrepareAndFinalize(EMULATED.buffers.get(grp, req, api), num_experts=num_experts,
                                        hidden=hidden, use_fp8_dispatch=use_fp8_dispatch,
                                        dequantize_received=dequantize_received, timeout_s=timeout_s)
    pf.peer_checks = False  # no peers to wait for or to watch
    pf.name = f"emulated:{layout}"
    pf.emulated_ep = (ep_size, rank)
    return pf
