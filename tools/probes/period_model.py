"""A model of an MoE layer's overlap schedules: ops queued by the host on the compute stream(s)
and one link, each starting when its resource is free and the ops it needs have ended.

Every schedule is built from the same per-layer part times (:class:`Parts`, ms for the whole
batch of one rank) and simulated over many layers; :func:`simulate` returns the steady-state
period per layer. The schedules (:data:`SCHEDULES`):

* ``serial``: one batch, every op in turn on one resource (compute + comm);
* ``plain``: one batch with its shared expert beside the combine (the plain forward of
  ``dbo.bench overlap`` and ``dbo.moe.MoEKernel``);
* ``dbo``: two ubatches in dbo's queue order (A's attention and dispatch, B's, A's experts,
  shared expert and combine, B's, then the next layer), one comm stream served in queue order;
* ``dbo-2comm``: a comm stream per ubatch: the one link serves transfers as their data becomes
  ready instead of in queue order;
* ``dbo-attn``: the next layer's attention on a compute stream of its own, at high priority: it
  starts as soon as its input is there, and the compute op it lands beside pauses while it runs
  (the SMs are shared: the compute stream's work is conserved);
* ``dbo-attn-2comm``: both;
* ``sbo``: single-batch overlap, no split: the shared expert runs beside the dispatch, the routed
  experts run in ``groups`` groups by expert, each group's combine leaves as its down GEMM ends;
* ``sbo+dbo``, ``sbo+dbo-2comm``: two ubatches, each laid out as ``sbo``, in dbo's queue order.

Per ubatch of a two-ubatch schedule, compute ops take half the batch's time times
``Parts.split`` (what splitting costs: half-size GEMMs, each ubatch re-reading the weights);
a transfer of a share ``f`` of a part's bytes takes ``latency + f * (part - latency)``. Grouped
combines carry ``Parts.combine_bytes`` times the bytes of one combine
(:func:`partial_sum_bytes_factor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb

__all__ = ["SCHEDULES", "Parts", "Schedule", "partial_sum_bytes_factor", "simulate"]


@dataclass(frozen=True)
class Parts:
    """One MoE layer's parts, ms for the whole batch of one rank, measured without overlap.

    ``dispatch`` and ``combine`` each include one ``latency``; ``split`` multiplies every compute
    op of a ubatch when the batch is split in two; ``combine_bytes`` multiplies the combine's
    bytes when the experts run in groups (the partial rows of a token, one per group it hit).
    """

    attn: float
    experts: float
    dispatch: float
    combine: float
    shared: float = 0.0
    latency: float = 0.0
    split: float = 1.0
    combine_bytes: float = 1.0

    def __post_init__(self) -> None:
        for name in ("attn", "experts", "dispatch", "combine", "shared", "latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 ms, got {getattr(self, name)}")
        if min(self.dispatch, self.combine) < self.latency:
            raise ValueError(f"dispatch ({self.dispatch}) and combine ({self.combine}) must each be "
                             f">= latency ({self.latency}): each transfer includes one")
        if self.split < 1 or self.combine_bytes < 1:
            raise ValueError(f"split ({self.split}) and combine_bytes ({self.combine_bytes}) must "
                             "be >= 1")

    @property
    def compute(self) -> float:
        return self.attn + self.experts + self.shared

    @property
    def comm(self) -> float:
        return self.dispatch + self.combine


@dataclass(frozen=True)
class Schedule:
    """How a layer's ops are laid out: ``ubatches`` 1 or 2; ``attn_stream``: the attention on a
    stream of its own; ``link_order`` ``fifo`` (queue order) or ``ready`` (as data becomes ready);
    ``grouped``: the experts in groups with a combine each; ``shared_beside``: the transfer the
    shared expert runs beside (``dispatch`` or ``combine``); ``serial``: one resource for all."""

    ubatches: int
    attn_stream: bool = False
    link_order: str = "fifo"
    grouped: bool = False
    shared_beside: str = "combine"
    serial: bool = False


SCHEDULES: dict[str, Schedule] = {
    "serial": Schedule(1, serial=True),
    "plain": Schedule(1),
    "dbo": Schedule(2),
    "dbo-2comm": Schedule(2, link_order="ready"),
    "dbo-attn": Schedule(2, attn_stream=True),
    "dbo-attn-2comm": Schedule(2, attn_stream=True, link_order="ready"),
    "sbo": Schedule(1, grouped=True, shared_beside="dispatch"),
    "sbo+dbo": Schedule(2, grouped=True, shared_beside="dispatch"),
    "sbo+dbo-2comm": Schedule(2, grouped=True, shared_beside="dispatch", link_order="ready"),
}


def partial_sum_bytes_factor(groups: int, local_experts: int, num_experts: int, topk: int) -> float:
    """Combine bytes with the experts in ``groups`` groups, over one combine (uniform routing).

    A backend whose sender sums a token's local experts (copy_engine, deepep_ht) sends one row
    per (token, rank) it holds experts of. Split into groups of ``local_experts / groups``
    experts, it sends one partial row per group the token hit: E[groups hit | >= 1 local expert
    hit] rows instead of one, where a group of g of the ``num_experts`` is missed by all ``topk``
    slots with probability C(E - g, k) / C(E, k). Backends that send a row per (token, expert)
    (deepep_ll) pay nothing: use 1.
    """
    if groups < 1 or local_experts % groups or not 0 < local_experts <= num_experts \
            or not 0 < topk <= num_experts:
        raise ValueError(f"need 1 <= groups dividing local_experts <= num_experts and 1 <= topk <= "
                         f"num_experts, got groups={groups}, local_experts={local_experts}, "
                         f"num_experts={num_experts}, topk={topk}")
    total = comb(num_experts, topk)
    group_hit = 1 - comb(num_experts - local_experts // groups, topk) / total
    any_hit = 1 - comb(num_experts - local_experts, topk) / total
    return groups * group_hit / any_hit


@dataclass(eq=False)
class _Op:
    resource: str
    ms: float
    after: list[_Op] = field(default_factory=list)
    end: float | None = None


def _ops(s: Schedule, p: Parts, layers: int, groups: int) -> list[_Op]:
    """The ops of ``layers`` layers in the order the host queues them."""
    n = s.ubatches
    cfac = p.split / n if n > 1 else 1.0
    groups = groups if s.grouped else 1
    link = "compute" if s.serial else "link"
    attn_res = "attn" if s.attn_stream else "compute"
    bytes_fac = p.combine_bytes if groups > 1 else 1.0

    def xfer(part: float, share: float) -> float:
        return p.latency + share * (part - p.latency)

    queue: list[_Op] = []
    ends: list[list[_Op]] = [[] for _ in range(n)]  # what each ubatch's next attention needs
    disp: list[_Op | None] = [None] * n

    def front(u: int) -> None:  # attention, dispatch (and the shared expert beside it)
        at = _Op(attn_res, p.attn * cfac, list(ends[u]))
        d = _Op(link, xfer(p.dispatch, 1 / n), [at])
        queue.extend([at, d])
        disp[u] = d
        ends[u] = []
        if s.shared_beside == "dispatch" and p.shared:
            sh = _Op("compute", p.shared * cfac, [at])
            queue.append(sh)
            ends[u].append(sh)

    for layer in range(layers):
        if layer == 0:
            for u in range(n):
                front(u)
        for u in range(n):
            prev = disp[u]
            for _ in range(groups):
                x = _Op("compute", p.experts * cfac / groups, [prev])
                c = _Op(link, xfer(p.combine, bytes_fac / (n * groups)), [x])
                queue.extend([x, c])
                ends[u].append(c)
                prev = x
            if s.shared_beside == "combine" and p.shared:
                sh = _Op("compute", p.shared * cfac, [disp[u]])
                queue.append(sh)
                ends[u].append(sh)
        if layer + 1 < layers:
            for u in range(n):
                front(u)
    return queue


def simulate(schedule: str, parts: Parts, layers: int = 40, groups: int = 2) -> float:
    """The steady-state period per layer (ms): what the last ``layers / 2`` layers add to the step.

    The step of ``layers`` layers minus that of ``layers // 2``, over the difference: ramp-up and
    drain cancel, and a resource that falls further behind every layer (a link that serves the
    next layer's dispatches first and leaves the combines for the end) is charged in full.
    ``groups`` is the number of expert groups of the ``sbo`` schedules (ignored by the others).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
    if layers < 12 or groups < 1:
        raise ValueError(f"need layers >= 12 and groups >= 1, got layers={layers}, groups={groups}")
    s = SCHEDULES[schedule]
    half = layers // 2
    step, load = _step(s, parts, layers, groups)
    marginal = (step - _step(s, parts, half, groups)[0]) / (layers - half)
    # where a resource falls further behind every layer the step converges slowly: its load
    # per layer is the long-run period then
    return max(marginal, load)


def _step(s: Schedule, parts: Parts, layers: int, groups: int) -> tuple[float, float]:
    """The time from the first op's start to the last op's end (ms), and the busiest resource's
    work per layer (ms; the attention stream's counts to the compute, whose SMs it takes)."""
    queues: dict[str, list[_Op]] = {}
    all_ops = _ops(s, parts, layers, groups)
    for op in all_ops:
        queues.setdefault(op.resource, []).append(op)
    free = dict.fromkeys(queues, 0.0)
    last_compute: _Op | None = None  # the compute op that ends at free["compute"]
    while any(queues.values()):
        best = None
        for res, q in queues.items():
            heads = q if (res == "link" and s.link_order == "ready") else q[:1]
            for pos, op in enumerate(heads):
                if any(d.end is None for d in op.after):
                    continue
                ready = max([d.end for d in op.after], default=0.0)
                key = (max(free[res], ready), ready, pos)
                if best is None or key < best[0]:
                    best = (key, res, op)
        if best is None:
            raise RuntimeError("the queues wait on each other")  # an inconsistent queue order
        (start, _, _), res, op = best
        if res == "compute" and "attn" in free:
            start = max(start, free["attn"])  # the attention holds the SMs while it runs
        op.end = start + op.ms
        free[res] = op.end
        queues[res].remove(op)
        if res == "compute":
            last_compute = op
        elif res == "attn" and last_compute is not None and last_compute.end > start:
            last_compute.end += op.ms  # paused while the attention runs
            free["compute"] = last_compute.end
    busy: dict[str, float] = {}
    for op in all_ops:
        res = "compute" if op.resource == "attn" else op.resource
        busy[res] = busy.get(res, 0.0) + op.ms
    return max(op.end for op in all_ops), max(busy.values()) / layers
