"""The link limit of a step's communication, measured on the group of the same run.

The compute columns of the overlap benchmark are read against the device's limit
(:mod:`dbo.bench.limits`); the comm column is read against this one:

* the **link rate** (:func:`measure_link`): every rank puts ``bytes_per_peer`` into every other
  rank's buffer at once, all ranks together, in ring order (rank ``r`` writes to ``r + 1``, ``r +
  2``, ...), with plain copies into torch symmetric memory, which the GPU's copy engines carry
  (on CUDA); the rate is the bytes one rank sends to its peers over the slowest rank's time. On
  the CPU it is a gloo ``all_to_all_single`` of the same bytes, a stand-in with the same shape;
* the **bytes each backend moves** per layer out of one rank (:func:`comm_bytes`), dispatch plus
  combine, from the layer's routing (remote = on another rank), by the way its activations move
  (``BackendSpec.traffic``):

  ====================  ======================================================================
  backend               bytes out of a rank per layer
  ====================  ======================================================================
  copy_engine           ``(W - 1) * T * (hidden * e + 2 * topk * 4)`` dispatch (every token
                        and its routing row to every peer) + ``(W - 1) * T * hidden * e``
                        combine (a partial sum back to every token's owner)
  naive                 ``2 * (W - 1) * T * hidden * e`` (all-gather, reduce-scatter)
  all2all, deepep_ht,   ``2 * R * hidden * e``, ``R`` = (token, remote rank) pairs: one copy of
  deepep_v2             a token per rank that holds one of its experts, there and back
  deepep_ll             ``2 * P * hidden * e``, ``P`` = (token, remote expert) pairs: one copy
                        per expert
  ====================  ======================================================================

  with ``W`` ranks, ``T`` tokens on this rank, ``e`` bytes per activation element. DeepEP's
  small metadata (indices, scales) is not counted.

``link_ms = bytes / link rate``; the benchmark prints ``comm / link_ms`` as ``x link``. The link
rate is of one transport (copy engines on CUDA); DeepEP's SM kernels move their bytes another way
and can beat it or not: the column says how far each backend is from what the copy engines move.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from dbo.backends import BACKENDS
from dbo.bench.limits import rate_text
from dbo.peers.collectives import collective_device

__all__ = ["LinkLimits", "measure_link", "comm_bytes", "COMM_BYTES_BACKENDS"]

#: the backends whose bytes :func:`comm_bytes` counts: those whose traffic is a known pattern
COMM_BYTES_BACKENDS = tuple(name for name, spec in BACKENDS.items() if spec.traffic is not None)


@dataclass(frozen=True)
class LinkLimits:
    """A measured link rate: ``gbps_out`` is the bytes one rank sends to its peers per second
    (GB/s), every rank sending at once (the slowest rank's time)."""

    transport: str
    world_size: int
    bytes_per_peer: int
    gbps_out: float

    def time_ms(self, bytes_out: float) -> float:
        """The link limit of moving ``bytes_out`` out of one rank (every rank alike): ms."""
        return bytes_out / (self.gbps_out * 1e9) * 1e3

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"link = {rate_text(self.gbps_out * 1e9, 'B/s')} out of each rank ({self.transport}, "
                f"all {self.world_size} ranks at once, {self.bytes_per_peer / 2**20:.0f} MiB to each "
                "peer), measured at the start of this run")


def _slowest(seconds: float, group: Any) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _cuda_put_s(group: Any, device: torch.device, nbytes: int, reps: int) -> float:
    from dbo.backends.copy_engine import destinations
    from dbo.backends.copy_engine.transport import symm_mem_rendezvous

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _, handle = symm_mem_rendezvous(world * nbytes, device, group)
    peers = [handle.get_buffer(r, (world * nbytes,), torch.uint8, 0) for r in range(world)]
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    order = [d for d in destinations(rank, world) if d != rank]

    def once() -> float:
        torch.cuda.synchronize(device)
        handle.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for d in order:
            peers[d][rank * nbytes:(rank + 1) * nbytes].copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    once()
    times = sorted(_slowest(once(), group) for _ in range(reps))
    torch.cuda.synchronize(device)
    handle.barrier()  # no rank frees its buffer while a peer may still write into it
    return times[len(times) // 2]


def _gloo_put_s(group: Any, nbytes: int, reps: int) -> float:
    world = dist.get_world_size(group)
    src = torch.zeros(world * nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def once() -> float:
        dist.barrier(group)
        t0 = time.perf_counter()
        dist.all_to_all_single(dst, src, group=group)
        return time.perf_counter() - t0

    once()
    times = sorted(_slowest(once(), group) for _ in range(reps))
    return times[len(times) // 2]


def measure_link(group: Any = None, device: torch.device | str = "cpu", *, bytes_per_peer: int | None = None,
                 reps: int = 5) -> LinkLimits | None:
    """Measure the link rate of ``group`` (collective: every rank calls it). None for one rank.

    ``bytes_per_peer`` defaults to 128 MiB on CUDA (well past the copy engines' start-up cost)
    and 4 MiB on the CPU.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    if world < 2:
        return None
    device = torch.device(device)
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if device.type == "cuda":
        nbytes = bytes_per_peer or 128 * 2**20
        seconds = _cuda_put_s(group, device, nbytes, reps)
        transport = "copy-engine puts into symmetric memory, ring order"
    else:
        nbytes = bytes_per_peer or 4 * 2**20
        seconds = _gloo_put_s(group, nbytes, reps)
        transport = "gloo all_to_all_single"
    return LinkLimits(transport, world, nbytes, (world - 1) * nbytes / seconds / 1e9)


def comm_bytes(backend: str, topk_ids: torch.Tensor, *, world_size: int, rank: int, num_experts: int,
               hidden: int, elem_bytes: int, dispatch_elem_bytes: float | None = None) -> int:
    """Bytes one layer's dispatch and combine move out of this rank (see the module docstring).

    Args:
        backend: a name of :data:`COMM_BYTES_BACKENDS`.
        topk_ids: ``[T, topk]`` global expert ids of this rank's tokens (``-1``: no expert).
        world_size, rank: the expert-parallel group; experts are placed contiguously
            (``num_experts // world_size`` per rank).
        hidden, elem_bytes: activation width and bytes per element.
        dispatch_elem_bytes: bytes per element of the dispatch where it differs (an fp8
            dispatch: ``1 + 4 / 128`` with its block scales); the combine keeps ``elem_bytes``.
    """
    spec = BACKENDS.get(backend)
    traffic = None if spec is None else spec.traffic
    if traffic is None:
        raise ValueError(f"comm_bytes knows {COMM_BYTES_BACKENDS}, not {backend!r}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, topk], got shape {tuple(topk_ids.shape)}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not a multiple of world_size={world_size}")
    tokens, topk = topk_ids.shape
    row = hidden * elem_bytes
    # a row there and back: the dispatch's (maybe narrower) and the combine's
    both = round(hidden * (elem_bytes if dispatch_elem_bytes is None else dispatch_elem_bytes)) + row
    if traffic == "to_every_rank":
        return (world_size - 1) * tokens * (both + 2 * topk * 4)
    if traffic == "gather":
        return (world_size - 1) * tokens * both
    ids = topk_ids.to(torch.int64)
    owner = torch.div(ids, num_experts // world_size, rounding_mode="floor")
    remote = (ids >= 0) & (owner != rank)
    if traffic == "per_expert":
        return int(remote.sum()) * both
    hits = torch.zeros(tokens, world_size, dtype=torch.int32, device=ids.device)
    hits.scatter_add_(1, owner.clamp(0, world_size - 1), remote.to(torch.int32))
    return int((hits > 0).sum()) * both
