"""A conformance suite for prepare/finalize backends: ours and users'.

Every rank of a process group runs :func:`run_case` for the same :class:`ConformanceCase`; it
builds the backend with the user's factory, runs one MoE layer (:class:`dbo.moe.MoEKernel`
with the reference SwiGLU experts) on this rank's tokens three ways and compares them:

* ``reference``: :func:`dbo.experts.reference.reference_moe`, single process, float32, all experts
  (a backend with ``emulated_ep = (N, r)``, one process playing rank ``r`` of ``N``: its local
  experts with :func:`dbo.moe.validate.stand_in_local_ids`; it needs no process group);
* ``serial``: the backend without DBO;
* ``dbo``: the same tokens cut into ``num_ubatches`` ubatches (uneven sizes, some may be empty)
  run overlapped with :func:`dbo.run_ubatches`, outputs concatenated.

It checks ``dbo == serial`` (tight) and ``serial == reference`` (bf16 tolerance), and the
protocol: per-ubatch handles (with ``force_interleave`` the suite yields after every
receiver-only ``prepare_async``/``finalize_async``, so ubatch 1 prepares before ubatch 0
finalizes even for backends that never yield), the hook flow (every registered hook ran; a
backend that returns ``(hook, receiver)`` really registers them), zero-token ranks and
ubatches, and that a second DBO run and a serial run after it give the same numbers (no state
left behind). CPU (gloo) and CUDA (NCCL) alike.

Use from pytest with :class:`dbo.testing.dist.DistWorld`::

    def make_backend(case):          # module level: it is pickled by reference
        return MyPrepareAndFinalize(dist.group.WORLD, hidden_size=case.hidden, ...)

    def test_my_backend(world2):
        check_backend(world2, make_backend, default_cases(2))

or under ``torchrun`` (each rank calls ``run_case`` in the same order and prints the results).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from dbo.expert_schedule import use_expert_schedule
from dbo.experts.reference import local_expert_weights, make_expert_weights, reference_moe, relative_error
from dbo.experts.swiglu import SwiGLUExperts
from dbo.moe.base import PrepareAndFinalize
from dbo.moe.kernel import MoEKernel
from dbo.moe.router import topk_route
from dbo.moe.validate import stand_in_local_ids
from dbo.ubatch.context import dbo_enabled, dbo_yield, run_ubatches
from dbo.ubatch.trace import Trace

__all__ = [
    "ConformanceCase",
    "CaseResult",
    "BackendFactory",
    "InterleavingBackend",
    "default_cases",
    "run_case",
    "run_cases",
    "check_backend",
    "format_results",
    "with_options",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConformanceCase:
    """One layer configuration. ``num_tokens[r]`` is rank ``r``'s token count (0 allowed).

    ``ubatch_sizes``: the DBO split of each rank's tokens (fractions of ``num_tokens[r]``,
    rounded; default an uneven 2-way split). ``expert_schedule``: how the DBO runs' routed
    experts run (``"split"``; ``"merged"``: one call over every ubatch's rows; ``"sbo"``: the
    batch unsplit, the shared experts beside the dispatch and, where the backend combines per
    expert group, a combine per group; ``"sbo+dbo"``: split, each ubatch laid out as ``sbo``).
    ``tol_ref``/``tol_dbo``: relative-error bounds of serial vs reference and DBO vs serial.
    ``options``: free-form settings for the factory.
    """

    name: str
    num_tokens: tuple[int, ...]
    hidden: int = 256
    topk: int = 2
    num_experts: int = 8
    intermediate: int = 64
    num_ubatches: int = 2
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    apply_router_weight_on_input: bool = False
    reduce_in_experts: bool = True
    force_interleave: bool = True
    expert_schedule: str = "split"
    #: expert groups of the grouped schedules (``MoEKernel.sbo_groups``)
    sbo_groups: int = 2
    tol_ref: float = 2e-2
    tol_dbo: float = 1e-2
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    @property
    def max_tokens_per_rank(self) -> int:
        return max(max(self.num_tokens), 1)


@dataclass
class CaseResult:
    """What one rank measured for one case. ``ok`` is the verdict; ``problems`` says why not."""

    case: str
    rank: int
    num_tokens: int
    err_serial_vs_ref: float
    err_dbo_vs_serial: float
    err_rerun: float
    hooks_registered: int
    hooks_run: int
    yields: int
    ok: bool
    problems: list[str] = field(default_factory=list)

    def row(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (f"{verdict}  {self.case:<40s} rank {self.rank}  T={self.num_tokens:<5d} "
                f"ser~ref {self.err_serial_vs_ref:8.2e}  dbo~ser {self.err_dbo_vs_serial:8.2e}  "
                f"rerun {self.err_rerun:8.2e}  hooks {self.hooks_run}/{self.hooks_registered}  "
                f"yields {self.yields}" + ("" if self.ok else "  <- " + "; ".join(self.problems)))


BackendFactory = Callable[[ConformanceCase], PrepareAndFinalize]


class InterleavingBackend(PrepareAndFinalize):
    """Wraps a backend and yields after each receiver-only ``prepare_async``/``finalize_async``
    under DBO, so the other ubatch starts its own dispatch before this one receives: a backend
    that keeps one handle instead of one per ubatch then mixes them up. ``(hook, receiver)``
    results are passed through untouched (the kernel yields for those)."""

    def __init__(self, inner: PrepareAndFinalize):
        self.inner = inner
        self.group_combines = 0  #: per-group combines passed through (the sbo schedule)

    @property
    def activation_format(self):
        return self.inner.activation_format

    def topk_indices_dtype(self):
        return self.inner.topk_indices_dtype()

    def max_num_tokens_per_rank(self):
        return self.inner.max_num_tokens_per_rank()

    def num_dispatchers(self):
        return self.inner.num_dispatchers()

    def output_is_reduced(self):
        return self.inner.output_is_reduced()

    def supports_async(self):
        return self.inner.supports_async()

    def prepare(self, *args, **kwargs):
        return self.inner.prepare(*args, **kwargs)

    def finalize(self, *args, **kwargs):
        return self.inner.finalize(*args, **kwargs)

    def prepare_async(self, *args, **kwargs):
        res = self.inner.prepare_async(*args, **kwargs)
        if not isinstance(res, tuple) and dbo_enabled():
            dbo_yield()
        return res

    def finalize_async(self, *args, **kwargs):
        res = self.inner.finalize_async(*args, **kwargs)
        if not isinstance(res, tuple) and dbo_enabled():
            dbo_yield()
        return res

    def supports_expert_groups(self):
        return self.inner.supports_expert_groups()

    def finalize_group_async(self, *args, **kwargs):
        self.group_combines += 1
        return self.inner.finalize_group_async(*args, **kwargs)

    def reset(self) -> None:
        self.inner.reset()


def default_cases(world_size: int, *, hidden: int = 256, num_experts: int = 8,
                  dtype: torch.dtype = torch.bfloat16, topks: Sequence[int] = (1, 2, 4),
                  max_tokens: int = 24) -> list[ConformanceCase]:
    """A small spread: even and uneven token counts, a rank with zero tokens, top-k values,
    router weight on the input, unreduced experts output, three ubatches."""
    even = tuple([max_tokens] * world_size)
    uneven = tuple(max_tokens - 5 * r for r in range(world_size))
    zero = tuple([0] + [max_tokens - 3] * (world_size - 1))
    cases = [ConformanceCase(f"even topk={k}", even, hidden, k, num_experts, dtype=dtype, seed=k)
             for k in topks]
    cases += [
        ConformanceCase("uneven", uneven, hidden, 2, num_experts, dtype=dtype, seed=11),
        ConformanceCase("zero-token rank", zero, hidden, 2, num_experts, dtype=dtype, seed=12),
        ConformanceCase("router weight on input", even, hidden, 1, num_experts, dtype=dtype,
                        seed=13, apply_router_weight_on_input=True),
        ConformanceCase("experts leave reduce to finalize", even, hidden, 2, num_experts,
                        dtype=dtype, seed=14, reduce_in_experts=False),
        ConformanceCase("3 ubatches", even, hidden, 2, num_experts, dtype=dtype, seed=15,
                        num_ubatches=3),
    ]
    return cases


def _inputs(case: ConformanceCase, rank: int, world: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * case.seed + rank)
    t = case.num_tokens[rank]
    x = torch.randn(t, case.hidden, generator=g).to(case.dtype)
    logits = torch.randn(t, case.num_experts, generator=g)
    weights, ids = topk_route(logits, case.topk, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(case.num_experts, case.hidden, case.intermediate, dtype=case.dtype,
                                 seed=case.seed)
    return (x.to(device), weights.to(device), ids.to(device), w1.to(device), w2.to(device),
            local_expert_weights(w1, rank, world).to(device),
            local_expert_weights(w2, rank, world).to(device))


def _split(n: int, parts: int) -> list[int]:
    """Uneven split of ``n`` rows into ``parts`` ubatches (first ones larger; some may be 0)."""
    if parts == 2:
        first = (2 * n + 2) // 3
        return [first, n - first]
    base = [n // parts] * parts
    for i in range(n % parts):
        base[i] += 1
    return base


def run_case(factory: BackendFactory, case: ConformanceCase, *, device: str | torch.device = "cpu",
             group: Any = None) -> CaseResult:
    """Run ``case`` on this rank (collective: every rank of ``group`` calls it) and compare."""
    device = torch.device(device)
    backend = factory(case)
    # a backend that plays rank r of N alone (dbo.backends.emulated) needs no process group:
    # its own tokens stand in for its peers', so it computes its local experts' MoE of them
    emulated = getattr(backend, "emulated_ep", None)
    world, rank = emulated if emulated is not None else (dist.get_world_size(group), dist.get_rank(group))
    x, weights, ids, w1, w2, w1_local, w2_local = _inputs(case, rank, world, device)
    sbo = case.expert_schedule == "sbo"
    grouped = case.expert_schedule in ("sbo", "sbo+dbo")
    pf = InterleavingBackend(backend) if case.force_interleave or grouped else backend
    kernel = MoEKernel(pf, SwiGLUExperts(reduce_in_experts=case.reduce_in_experts))
    kernel.sbo_groups = case.sbo_groups
    kw = dict(global_num_experts=case.num_experts,
              apply_router_weight_on_input=case.apply_router_weight_on_input)
    problems: list[str] = []

    def layer(rows: slice) -> torch.Tensor:
        return kernel(x[rows], w1_local, w2_local, weights[rows], ids[rows], **kw)

    def dbo_run(trace: Trace | None) -> torch.Tensor:
        if sbo:  # single-batch overlap: the batch unsplit, no run
            with use_expert_schedule("sbo"):
                return layer(slice(None))
        sizes = _split(x.shape[0], case.num_ubatches)
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        fns = [(lambda s=slice(bounds[i], bounds[i + 1]): layer(s)) for i in range(len(sizes))]
        with use_expert_schedule(case.expert_schedule):
            outs = run_ubatches(fns, token_offsets=bounds[:-1], trace=trace, device=device.type)
        return torch.cat(outs) if outs else x.new_empty(0, case.hidden)

    if emulated is None:
        ref = reference_moe(x, w1, w2, weights, ids,
                            apply_router_weight_on_input=case.apply_router_weight_on_input)
    else:
        ref = reference_moe(x, w1_local, w2_local, weights,
                            stand_in_local_ids(ids, case.num_experts, world),
                            apply_router_weight_on_input=case.apply_router_weight_on_input)
    serial = layer(slice(None))
    trace = Trace()
    overlapped = dbo_run(trace)
    again = dbo_run(None)
    serial_again = layer(slice(None))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    err_ref = relative_error(serial, ref)
    err_dbo = relative_error(overlapped, serial)
    err_rerun = max(relative_error(again, overlapped), relative_error(serial_again, serial))
    kinds = [e.kind for e in trace.events]
    registered, ran = kinds.count("hook_register"), kinds.count("hook_begin")
    yields = kinds.count("suspend")
    for name, out in (("serial", serial), ("dbo", overlapped)):
        if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
            problems.append(f"{name} output is {tuple(out.shape)} {out.dtype}, want "
                            f"{tuple(x.shape)} {x.dtype}")
        if not torch.isfinite(out.float()).all():
            problems.append(f"{name} output has NaN/inf (read before the receive completed?)")
    if err_ref > case.tol_ref:
        problems.append(f"serial vs reference {err_ref:.3g} > {case.tol_ref}")
    if err_dbo > case.tol_dbo:
        problems.append(f"dbo vs serial {err_dbo:.3g} > {case.tol_dbo}")
    if err_rerun > case.tol_dbo:
        problems.append(f"a second run differs by {err_rerun:.3g} (state left behind?)")
    if registered != ran:
        problems.append(f"{registered} hooks registered, {ran} ran")
    regions = [e.detail for e in trace.events if e.kind == "region_begin"]
    if grouped and backend.supports_expert_groups() and x.shape[0] and pf.group_combines < 2:
        problems.append(f"{case.expert_schedule} schedule: {pf.group_combines} per-group combines "
                        "(want at least 2 per call on a backend that combines per group)")
    if case.expert_schedule == "merged" and regions.count("experts_merged") != 1:
        problems.append(f"merged schedule: {regions.count('experts_merged')} merged experts calls "
                        f"(want 1), {regions.count('experts')} per-ubatch ones")
    return CaseResult(case.name, rank, x.shape[0], err_ref, err_dbo, err_rerun, registered, ran,
                      yields, not problems, problems)


def run_cases(factory: BackendFactory, cases: Sequence[ConformanceCase], *,
              device: str | torch.device = "cpu", group: Any = None) -> list[CaseResult]:
    """:func:`run_case` for each case; an exception becomes a failed result (the group may be
    out of step after one, so the remaining cases are skipped)."""
    out = []
    for case in cases:
        try:
            out.append(run_case(factory, case, device=device, group=group))
        except Exception as exc:  # noqa: BLE001 - reported as a failed case
            logger.exception("conformance case %r failed", case.name)
            rank = dist.get_rank(group)
            out.append(CaseResult(case.name, rank, case.num_tokens[rank], float("nan"), float("nan"),
                                  float("nan"), 0, 0, 0, False, [f"{type(exc).__name__}: {exc}"]))
            break
    return out


def format_results(results: Sequence[CaseResult]) -> str:
    """One line per (case, rank), failures marked."""
    return "\n".join(r.row() for r in results)


def check_backend(world: Any, factory: BackendFactory, cases: Sequence[ConformanceCase], *,
                  timeout_s: float = 120.0) -> list[CaseResult]:
    """Run ``cases`` on every rank of a :class:`dbo.testing.dist.DistWorld`; raise
    ``AssertionError`` with the whole table if any case failed on any rank."""
    per_rank = world.run(run_cases, factory, list(cases), timeout_s=timeout_s)
    results = [r for rank_results in per_rank for r in rank_results]
    results.sort(key=lambda r: (r.case, r.rank))
    if not all(r.ok for r in results) or len(results) != len(cases) * world.world_size:
        raise AssertionError("backend conformance failed:\n" + format_results(results))
    return results


def with_options(case: ConformanceCase, **options: Any) -> ConformanceCase:
    """``case`` with ``options`` merged into its factory options (and the name tagged)."""
    merged = {**dict(case.options), **options}
    tag = ",".join(f"{k}={v}" for k, v in options.items())
    return replace(case, name=f"{case.name} [{tag}]", options=tuple(sorted(merged.items())))

