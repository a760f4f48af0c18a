"""Reproducible MoE test cases for any prepare/finalize backend, sequential and overlapped.

A :class:`MoECase` describes one step of an expert-parallel MoE layer over a world of ranks:
token counts per rank, routing style, sizes, dtype. Every rank derives the same global data
from the case's seed and takes its own slice, so a case is a few bytes to send to a
:class:`dbo.testing.dist.DistWorld` job. :func:`check_case` runs the backend plainly and with
DBO and compares both with :func:`dbo.experts.reference_moe` and with each other.

Routing styles: ``"random"``; ``"avoid_rank:R"`` (no token picks an expert of rank R, which
then receives nothing); ``"padding"`` (about a quarter of the rows route to no expert, ``-1``
everywhere, as the split's padding rows do, and some single slots are ``-1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dbo.expert_schedule import use_expert_schedule
from dbo.experts.reference import local_expert_weights, make_expert_weights, reference_moe, relative_error
from dbo.experts.swiglu import SwiGLUExperts
from dbo.moe.base import PrepareAndFinalize
from dbo.moe.kernel import MoEKernel
from dbo.moe.router import topk_route
from dbo.ubatch.context import dbo_region, run_ubatches
from dbo.ubatch.trace import Trace

__all__ = ["MoECase", "CaseInputs", "CaseReport", "case_inputs", "run_case", "reference_case",
           "check_case", "standard_cases", "TOLERANCE"]

#: the match criterion: relative error (norm of difference / norm of reference) per dtype
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(frozen=True)
class MoECase:
    """One MoE step over ``len(tokens_per_rank)`` ranks."""

    seed: int
    tokens_per_rank: tuple[int, ...]
    num_experts: int
    topk: int = 2
    hidden: int = 32
    intermediate: int = 16
    dtype: str = "float32"
    routing: str = "random"
    reduce_in_experts: bool = True
    router_on_input: bool = False
    layers: int = 1
    ids_dtype: str = "int32"

    @property
    def world_size(self) -> int:
        return len(self.tokens_per_rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class CaseInputs:
    """One rank's inputs: ``x`` ``[M, hidden]``, ``topk_weights`` ``[M, topk]`` float32,
    ``topk_ids`` ``[M, topk]`` global ids; global and local expert weights; ``mix`` ``[hidden,
    hidden]`` for the stand-in attention of multi-layer cases."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w1_all: torch.Tensor
    w2_all: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    mix: torch.Tensor


@dataclass
class CaseReport:
    """Relative errors of one case on one rank (``nan`` when a path was not run)."""

    err_seq: float
    err_dbo: float
    err_dbo_vs_seq: float
    tol: float
    num_tokens: int

    @property
    def ok(self) -> bool:
        return max(self.err_seq, self.err_dbo, self.err_dbo_vs_seq) <= self.tol


def case_inputs(case: MoECase, rank: int, device: str | torch.device = "cpu") -> CaseInputs:
    """Rank ``rank``'s slice of the case's global data (the same on every rank), on
    ``device``."""
    g = torch.Generator().manual_seed(case.seed)
    total = sum(case.tokens_per_rank)
    e, ws = case.num_experts, case.world_size
    x = torch.randn(total, case.hidden, generator=g)
    logits = torch.randn(total, e, generator=g)
    if case.routing.startswith("avoid_rank:"):
        r = int(case.routing.split(":")[1])
        n_local = e // ws
        logits[:, r * n_local:(r + 1) * n_local] = float("-inf")
    weights, ids = topk_route(logits, case.topk, ids_dtype=getattr(torch, case.ids_dtype))
    if case.routing == "padding":
        rows = torch.rand(total, generator=g) < 0.25
        ids[rows] = -1
        weights[rows] = 0.0
        slots = torch.rand(ids.shape, generator=g) < 0.1
        ids[slots] = -1
    w1_all, w2_all = make_expert_weights(e, case.hidden, case.intermediate,
                                         dtype=case.torch_dtype, seed=case.seed + 1)
    mix = (torch.randn(case.hidden, case.hidden, generator=g) / case.hidden ** 0.5)
    start = sum(case.tokens_per_rank[:rank])
    sl = slice(start, start + case.tokens_per_rank[rank])
    dt = case.torch_dtype
    return CaseInputs(x[sl].to(device, dt), weights[sl].to(device), ids[sl].to(device),
                      w1_all.to(device), w2_all.to(device),
                      local_expert_weights(w1_all, rank, ws).to(device),
                      local_expert_weights(w2_all, rank, ws).to(device), mix.to(device, dt))


def _layers(case: MoECase, inp: CaseInputs, h: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, moe: Callable[..., torch.Tensor]) -> torch.Tensor:
    # layer: stand-in attention, then a residual MoE with the step's fixed routing
    for _ in range(case.layers):
        with dbo_region("attention"):
            a = torch.tanh(h @ inp.mix)
        h = h + moe(a, weights, ids)
    return h


def run_case(case: MoECase, inp: CaseInputs, backend: PrepareAndFinalize, *, use_dbo: bool,
             num_ubatches: int = 2, trace: Trace | None = None,
             device: str = "cpu", expert_schedule: str = "split") -> torch.Tensor:
    """This rank's output ``[M, hidden]``: plainly, or split into ``num_ubatches`` contiguous
    ubatches run with :func:`dbo.run_ubatches` (each rank runs the same number of ubatches,
    some possibly empty) under ``expert_schedule`` (``"split"`` or ``"merged"``; ``"sbo"``
    runs the batch unsplit under that schedule instead)."""
    kernel = MoEKernel(backend, SwiGLUExperts(reduce_in_experts=case.reduce_in_experts))

    def moe(a: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return kernel.forward(a, inp.w1, inp.w2, w, i, global_num_experts=case.num_experts,
                              apply_router_weight_on_input=case.router_on_input)

    if not use_dbo:
        return _layers(case, inp, inp.x, inp.topk_weights, inp.topk_ids, moe)
    if expert_schedule == "sbo":  # single-batch overlap: the batch unsplit, no run
        with use_expert_schedule(expert_schedule):
            return _layers(case, inp, inp.x, inp.topk_weights, inp.topk_ids, moe)
    parts = list(zip(torch.tensor_split(inp.x, num_ubatches),
                     torch.tensor_split(inp.topk_weights, num_ubatches),
                     torch.tensor_split(inp.topk_ids, num_ubatches), strict=True))
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + p[0].shape[0])
    fns = [lambda p=p: _layers(case, inp, p[0], p[1], p[2], moe) for p in parts]
    with use_expert_schedule(expert_schedule):
        outs = run_ubatches(fns, token_offsets=offsets, trace=trace, device=device)
    return torch.cat(outs)


def reference_case(case: MoECase, inp: CaseInputs) -> torch.Tensor:
    """The trusted output for this rank's tokens (float32 math, cast to the case's dtype)."""

    def moe(a: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return reference_moe(a, inp.w1_all, inp.w2_all, w, i,
                             apply_router_weight_on_input=case.router_on_input)

    return _layers(case, inp, inp.x, inp.topk_weights, inp.topk_ids, moe)


def check_case(case: MoECase, rank: int, make_backend: Callable[[], PrepareAndFinalize], *,
               num_ubatches: int = 2, device: str = "cpu",
               expert_schedule: str = "split") -> CaseReport:
    """Run ``case`` on this rank plainly and with DBO (fresh backends from ``make_backend``;
    the DBO run under ``expert_schedule``) on ``device`` (``"cpu"`` or ``"cuda"``); return the
    relative errors against the reference and between the two."""
    inp = case_inputs(case, rank, device)
    ref = reference_case(case, inp)
    seq = run_case(case, inp, make_backend(), use_dbo=False, device=device)
    ovl = run_case(case, inp, make_backend(), use_dbo=True, num_ubatches=num_ubatches,
                   device=device, expert_schedule=expert_schedule)
    return CaseReport(relative_error(seq, ref), relative_error(ovl, ref), relative_error(ovl, seq),
                      TOLERANCE[case.dtype], inp.x.shape[0])


def standard_cases(world_size: int) -> list[MoECase]:
    """The fixed case list every backend should pass on ``world_size`` ranks: topk 1 to 8 with
    uneven token counts, a rank with zero tokens, no tokens anywhere, one token per rank (one
    ubatch empty), a rank that no token routes to, rows routed nowhere, bf16 over two layers,
    the router weight applied on the input, int64 ids with finalize-side weight-and-reduce."""
    e = 4 * world_size
    uneven = tuple(3 + 5 * r for r in range(world_size))
    cases = [MoECase(100 + k, uneven[::-1] if k % 2 else uneven, e, topk=k) for k in range(1, 9)]
    cases += [
        MoECase(200, (0,) + uneven[1:], e, topk=3),
        MoECase(201, (0,) * world_size, e, topk=2),
        MoECase(202, (1,) * world_size, e, topk=2),
        MoECase(203, uneven, e, topk=2, routing=f"avoid_rank:{world_size - 1}"),
        MoECase(204, uneven, e, topk=4, routing="padding"),
        MoECase(205, uneven, e, topk=2, dtype="bfloat16", layers=2),
        MoECase(206, uneven, e, topk=1, router_on_input=True, reduce_in_experts=False),
        MoECase(207, uneven, e, topk=3, reduce_in_experts=False, ids_dtype="int64", layers=2),
    ]
    return cases
