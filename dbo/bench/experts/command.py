"""The routed experts alone: :class:`dbo.experts.SwiGLUExperts` at the overlap benchmark's shapes.

    python -m dbo.bench experts                      # CUDA: the default grid, a table
    python -m dbo.bench experts --intermediate 256 768 2048 --tokens 4096 --json out.json
    python -m dbo.bench experts --layout batched     # the decode grid on low-latency slabs

A case is what one rank's experts get from a STANDARD-format backend: ``tokens`` received
tokens, each routed to ``topk`` of ``num_experts`` experts, of which this rank holds
``local_experts`` (the other slots are ``-1``), with the per-expert counts on the host as DeepEP
normal mode delivers them ("host counts") or not ("device offsets": naive, all2all). Each
implementation's ``apply`` is timed with CUDA events, alternating implementations step by step
so that clock drift hits them alike; the median per implementation is reported, with each row's
hardware limit and the ratio to it (:mod:`dbo.bench.limits`: bandwidth and GEMM rate measured at
the start of the same run). Two timings per implementation (``--timing``): the GPU's time of a
call queued behind other GPU work (as in a model's forward, where the host runs ahead; reported
under the implementation's name) and an isolated call's latency from an idle GPU, its host
launches included (``NAME, from idle``); each call's host time is in the JSON (``host_ms``).
:func:`time_experts` is reusable with other implementations (pass any callable with the
library's signature to time it against the library's in the same run).

``--layout batched`` times the other layout a backend delivers, DeepEP low-latency's
``[local experts, capacity, hidden]`` slabs with the per-expert counts on the device only
(:class:`BatchedCase`): ``tokens`` per rank over ``--ranks`` ranks, each sending as many, top-k of
``local experts x ranks`` experts, so that each slab has room for every token of every rank
(``capacity = tokens x ranks``) and expert ``e``'s rows are the first ``counts[e]`` of its slab.
Its default grid is the decode one (8, 32 and 128 local experts, 64/256/512 tokens per rank,
I=2048); the outputs are compared on the rows that arrived (the rest of a slab is left unwritten).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from dbo.bench.cli import ArgumentParser, check_writable_file, legend, verdict
from dbo.bench.experts.cases import BatchedCase, ExpertsCase, make_batched_case, make_case
from dbo.bench.experts.options import DEFAULT_GRID, LAYOUTS, TIMINGS, ExpertsOptions
from dbo.bench.experts.record import ExpertsResult, ExpertsRow, ImplTiming, limit_summary
from dbo.bench.limits import DeviceLimits, experts_cost, measure_device_limits
from dbo.bench.timing import gpu_sleep
from dbo.cli import run_main
from dbo.experts import SwiGLUExperts
from dbo.files import write_whole
from dbo.moe import MoEExperts, Workspace

__all__ = ["ExpertsCase", "BatchedCase", "make_case", "make_batched_case", "apply_experts", "experts_call",
           "time_experts", "run_grid", "add_limits", "format_rows", "limit_summary", "parse_args", "main"]

PROG = "python -m dbo.bench experts"
EXPERTS_TOLERANCE = 2e-2  #: bf16: the largest relative error between implementations' outputs


class _Stopwatch:
    """CUDA events around a block on CUDA (read after a sync), ``perf_counter`` on the CPU; the
    host time of the block either way (``host_ms``)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __enter__(self) -> None:
        if self.cuda:
            self.start.record()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.host_ms = (time.perf_counter() - self.t0) * 1e3
        if self.cuda:
            self.end.record()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end) if self.cuda else self.host_ms


#: what each timing measures (``time_experts``'s ``timings``); ``device`` keeps the
#: implementation's name, ``idle`` adds this suffix
IDLE_SUFFIX = ", from idle"


def apply_experts(experts: MoEExperts, case: ExpertsCase | BatchedCase, host_counts: bool,
                  ws: Workspace) -> torch.Tensor:
    """One call of ``experts`` on ``case`` in its layout (the backend's host-side counts when
    ``host_counts``, else on the device only), scratch from ``ws``. Returns the experts' output
    in the case's dtype: ``[M, hidden]``, or the slabs ``[L, capacity, hidden]``."""
    return case.apply(experts, host_counts, ws)


def experts_call(case: ExpertsCase, experts: MoEExperts | None = None, *, num_experts: int = 256,
                 host_counts: bool = False) -> Callable[[], torch.Tensor]:
    """One call of ``experts`` (default the library's :class:`SwiGLUExperts`) on ``case`` as the
    grid makes it (told the global expert count, a workspace of its own), for the probes and
    profilers that run it on their own."""
    experts = SwiGLUExperts() if experts is None else experts
    experts.note_global_num_experts(num_experts)
    ws = Workspace()
    return lambda: apply_experts(experts, case, host_counts, ws)


def time_experts(impls: dict[str, tuple[MoEExperts, bool]], case: ExpertsCase | BatchedCase, *,
                 steps: int = 30,
                 warmup: int = 5,
                 timings: tuple[str, ...] = ("device", "idle")) -> dict[str, dict[str, float]]:
    """Time each ``name -> (experts, host_counts)`` on ``case``, alternating step by step.

    On CUDA, ``timings`` picks what is measured (CUDA events around each call):

    * ``"device"`` (reported as ``name``): each call queued behind a GPU sleep longer than its
      host time, so that the host has launched all of it before the GPU starts it: the GPU's
      time, as inside a model's forward where the host runs ahead of the GPU;
    * ``"idle"`` (reported as ``name + IDLE_SUFFIX``): each call after a host sync, from an idle
      GPU: the latency of an isolated call, the host's launches included (small calls are
      launch-bound here).

    On the CPU each call's wall time (``name``). Returns ``name -> {"median_ms", "p10_ms",
    "p90_ms", "rel_err", "host_ms"}``: ``host_ms`` the median host time of a call; ``rel_err``
    against the first implementation's output on the rows that arrived (the implementations
    must agree).
    """
    bad = set(timings) - {"device", "idle"}
    if bad or not timings:
        raise ValueError(f"timings are 'device' and/or 'idle', got {timings!r}")
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    for name, (experts, host) in impls.items():
        ws = Workspace()
        calls[name] = lambda e=experts, h=host, w=ws: apply_experts(e, case, h, w)
    outs = {name: case.arrived(fn()).float().clone() for name, fn in calls.items()}
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    cuda = case.x.is_cuda
    lead_ms: dict[str, float] = {}  # CUDA: the GPU sleep ahead of each call ("device")
    if cuda:
        # an idle GPU runs at a low clock until it has been busy for a while: the first rows of
        # a grid read up to 2x slow without this (seen on an H200)
        torch.cuda.synchronize()
        host: dict[str, list[float]] = {name: [] for name in calls}
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            for name, fn in calls.items():
                t = time.perf_counter()
                fn()
                host[name].append(time.perf_counter() - t)
            torch.cuda.synchronize()
        # twice the slowest warm host time, at least 50 us, at most 5 ms (a call that waits for
        # the GPU from the host needs more than any sleep: its launches after the wait count)
        lead_ms = {name: min(5.0, max(0.05, 2e3 * max(host[name]))) for name in calls}
    else:
        timings = ("device",)
    kinds = [(k, name) for k in timings for name in calls]
    events = {kn: [_Stopwatch(cuda) for _ in range(steps)] for kn in kinds}
    for i in range(steps):
        for kind, name in kinds:
            if cuda and kind == "device":
                gpu_sleep(lead_ms[name])
            elif cuda:
                torch.cuda.synchronize()
            with events[kind, name][i]:
                calls[name]()
    if cuda:
        torch.cuda.synchronize()
    first = outs[next(iter(outs))]
    res = {}
    for kind, name in kinds:
        watches = events[kind, name]
        times = sorted(w.ms() for w in watches)
        n = len(times)
        err = torch.linalg.vector_norm(outs[name] - first) / torch.linalg.vector_norm(first).clamp_min(1e-30)
        res[name if kind == "device" else name + IDLE_SUFFIX] = {
            "median_ms": statistics.median(times), "p10_ms": times[n // 10], "p90_ms": times[(9 * n) // 10],
            "rel_err": float(err), "host_ms": statistics.median(w.host_ms for w in watches)}
    return res


def run_grid(impls: dict[str, tuple[MoEExperts, bool]], *, hidden: list[int], intermediate: list[int],
             tokens: list[int], local_experts: list[int], topk: int = 8, steps: int = 30,
             num_experts: int = 256, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cuda", log: Callable[[str], None] | None = None,
             timings: tuple[str, ...] = ("device", "idle"), layout: str = "standard",
             ranks: int = 2) -> list[ExpertsRow]:
    """:func:`time_experts` over the grid; one row per shape (weights made once per size), no
    limits yet (:func:`add_limits`).
    ``layout``: ``"standard"`` (:func:`make_case`, ``num_experts`` over all ranks) or
    ``"batched"`` (:func:`make_batched_case`, ``tokens`` per rank over ``ranks`` ranks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rows = []
    for h in hidden:
        for inter in intermediate:
            for n_local in local_experts:
                w = None
                for t in tokens:
                    if layout == "batched":
                        case = make_batched_case(t, h, inter, n_local, ranks=ranks, topk=topk, dtype=dtype,
                                                 device=device, weights=w, seed=t)
                        counts = case.counts_cpu
                    else:
                        case = make_case(t, h, inter, n_local, num_experts=num_experts, topk=topk,
                                         dtype=dtype, device=device, weights=w, seed=t)
                        counts = case.counts
                    w = (case.w1, case.w2)
                    res = time_experts(impls, case, steps=steps, timings=timings)
                    batched = layout == "batched"
                    rows.append(ExpertsRow(
                        layout=layout, hidden=h, intermediate=inter, local_experts=n_local, tokens=t,
                        local_pairs=int(counts.sum()), experts_with_rows=int((counts > 0).sum()),
                        results={name: ImplTiming(**v) for name, v in res.items()},
                        ranks=ranks if batched else None, capacity=case.x.shape[1] if batched else None))
                    if log is not None:
                        log(f"H={h} I={inter} L={n_local} T={t}: " + ", ".join(
                            f"{k} {v['median_ms']:.3f} ms" for k, v in res.items()))
                del w, case
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def add_limits(rows: Sequence[ExpertsRow], limits: DeviceLimits, dtype_bytes: int = 2) -> list[ExpertsRow]:
    """The rows with their limit (``limit_ms``, and what bounds it: ``limit_bound``) and each
    result with its ratio to it (``x_limit``); where ``limits`` has the held GEMM rate, also
    ``held_limit_ms`` and ``x_held`` (else none: held figures from an earlier call are dropped)."""
    # informative: the limit at the GEMM rate held for seconds (a power cap's)
    held = limits.held_gemm_tflops is not None
    out = []
    for r in rows:
        flops, nbytes = experts_cost(hidden=r.hidden, intermediate=r.intermediate, local_pairs=r.local_pairs,
                                     experts_with_rows=r.experts_with_rows, dtype_bytes=dtype_bytes)
        limit_ms = limits.time_ms(flops, nbytes)
        held_ms = limits.time_ms(flops, nbytes, held=True) if held else None
        bound = "flops" if flops / limits.gemm_tflops / 1e12 > nbytes / limits.copy_gbps / 1e9 else "bytes"
        results = {name: dataclasses.replace(t, x_limit=t.median_ms / limit_ms,
                                             x_held=None if held_ms is None else t.median_ms / held_ms)
                   for name, t in r.results.items()}
        out.append(dataclasses.replace(r, results=results, limit_ms=limit_ms, limit_bound=bound,
                                       held_limit_ms=held_ms))
    return out


def format_rows(rows: Sequence[ExpertsRow], baseline: str) -> str:
    """A table: per shape the median ms of each implementation and ``baseline``'s time over it;
    with the limits (:func:`add_limits`), each time over the limit and a line per implementation
    summing them up."""
    names = list(rows[0].results) if rows else []
    lim = bool(rows) and rows[0].limit_ms is not None
    wid = {n: max(16, len(n)) for n in names}
    head = f"{'hidden':>6} {'I':>5} {'L':>4} {'tokens':>6} {'pairs':>7} {'rows/e':>6} " + " ".join(
        f"{n:>{wid[n]}}" + (f" {'x lim':>6}" if lim else "") for n in names)
    head += (f" {'limit':>8}" if lim else "") + "  " + " ".join(
        f"{(n[:10] + '/' + baseline[:10]):>21}" for n in names if n != baseline)
    lines = [head]
    for r in rows:
        res = r.results
        line = f"{r.hidden:>6} {r.intermediate:>5} {r.local_experts:>4} {r.tokens:>6} " \
               f"{r.local_pairs:>7} {r.pairs_per_expert:>6.0f} " + " ".join(
                   f"{res[n].median_ms:>{wid[n] - 3}.3f} ms"
                   + (f" {res[n].x_limit:>6.2f}" if lim else "") for n in names)
        line += (f" {r.limit_ms:>5.3f} ms" if lim else "") + "  " + " ".join(
            f"{res[n].median_ms / res[baseline].median_ms:>21.3f}" for n in names if n != baseline)
        lines.append(line)
    lines += legend({"hidden, I": "the hidden and each expert's intermediate size",
                     "L": "the rank's local experts", "tokens": "tokens per rank",
                     "pairs": "(token, expert) pairs routed to this rank", "rows/e": "pairs per expert "
                     "that has any", "NAME": "that implementation's median apply() time",
                     **({"x lim": "its time / limit", "limit": "the hardware limit (above)"} if lim else {}),
                     "A/B": f"A's time / {baseline}'s"})
    if lim:
        for name, s in limit_summary(rows).items():
            held = "" if "geomean_x_held" not in s else \
                f" ({s['geomean_x_held']:.2f}x the limit at the held GEMM rate)"
            lines.append(f"{name}: geometric mean {s['geomean_x_limit']:.2f}x the limit, worst "
                         f"{s['worst_x_limit']:.2f}x over {len(rows)} rows{held}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> ExpertsOptions:
    """The options of command line ``argv`` (default ``sys.argv[1:]``); bad input ends the
    program in one line, exit code 2."""
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=LAYOUTS, default="standard",
                   help="standard: the tokens a normal-mode or torch.distributed backend delivers; "
                        "batched: low-latency slabs [local experts, tokens x ranks, hidden] with the "
                        "counts on the device (default grid: the decode one)")
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--intermediate", type=int, nargs="+", default=None,
                   help="default 256 768 2048 (standard), 2048 (batched)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="standard: tokens this rank received (default 1024..65536); batched: tokens "
                        "each rank sends (default 64 256 512)")
    p.add_argument("--local-experts", type=int, nargs="+", default=None,
                   help="standard: of 256 (default 32 128 256); batched: of local x ranks (default 8 32 128)")
    p.add_argument("--ranks", type=int, default=2, help="batched: the ranks the slabs gather from")
    p.add_argument("--baseline-only", action="store_true",
                   help="time only the library's experts (not also the unfused steps)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timing", nargs="+", choices=TIMINGS, default=list(TIMINGS),
                   help="device: each call queued behind a GPU sleep (the GPU's time, as inside a "
                        "forward); idle: each call after a host sync (an isolated call's latency, "
                        "its launches included; reported as NAME" + IDLE_SUFFIX + ")")
    p.add_argument("--held-s", type=float, default=2.0,
                   help="also run the ceiling's GEMM back to back for this long and report each "
                        "row's ratio to the limit at that held rate (0: not)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    inter, tokens, local = DEFAULT_GRID[a.layout]
    try:
        opts = ExpertsOptions(layout=a.layout, hidden=a.hidden, intermediate=a.intermediate or inter,
                              tokens=a.tokens or tokens, local_experts=a.local_experts or local,
                              ranks=a.ranks, baseline_only=a.baseline_only, topk=a.topk, steps=a.steps,
                              timing=a.timing, held_s=a.held_s, json=a.json)
    except ValueError as exc:
        p.error(str(exc))
    if opts.json:
        check_writable_file(p, "--json", opts.json)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU; none here")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    limits = measure_device_limits(held_s=opts.held_s)
    print(limits.describe(), flush=True)
    if opts.layout == "batched":
        # the fused kernels over the rows that arrived, against two batched matmuls over the
        # whole slabs (what the experts run without Triton)
        impls = {"library": (SwiGLUExperts(), False)}
        if not opts.baseline_only:
            impls["slab bmm"] = (SwiGLUExperts(use_triton=False), False)
        what = (f"low-latency slabs of {opts.ranks} ranks' tokens, top-{opts.topk} of local experts x "
                f"{opts.ranks}, counts on the device")
    else:
        # what MoEKernel tells the experts: 256 experts over all ranks (a local share for the
        # kernel choice without host counts)
        impls = {"library, offsets": (SwiGLUExperts(num_global_experts=256), False)}
        if not opts.baseline_only:
            impls["unfused, offsets"] = (SwiGLUExperts(fused=False), False)
        what = f"top-{opts.topk} of 256 experts, device offsets"
    with torch.inference_mode():
        rows = run_grid(impls, hidden=opts.hidden, intermediate=opts.intermediate, tokens=opts.tokens,
                        local_experts=opts.local_experts, topk=opts.topk, steps=opts.steps,
                        log=lambda s: print(s, flush=True), timings=opts.timing, layout=opts.layout,
                        ranks=opts.ranks)
    result = ExpertsResult(limits, add_limits(rows, limits))
    # the first implementation under the first timing asked for (NAME, or NAME, from idle where
    # only --timing idle ran) is what the others are compared to
    first = result.names[0] if result.rows else next(iter(impls))
    print(f"dbo.bench experts: {torch.cuda.get_device_name()}, bf16, {what}, median of {opts.steps} "
          f"apply() calls (CUDA events: NAME = queued behind a GPU sleep, the GPU's time; "
          f"NAME{IDLE_SUFFIX} = after a host sync, an isolated call's latency); {limits.describe()}; "
          f"last columns: time over the first implementation's")
    print(format_rows(result.rows, first))
    if opts.json:
        write_whole(opts.json, json.dumps(result.to_json(), indent=1))
    worst = result.worst_rel_err
    speed = (f"{first} at {result.summary()[first]['geomean_x_limit']:.2f}x the limit "
             "(geometric mean)") if result.rows else "no shape timed"
    return verdict(PROG, bool(result.rows) and worst <= EXPERTS_TOLERANCE,
                   f"{len(result.rows)} shape(s), {speed}; every implementation within {worst:.1e} of "
                   f"{first}'s output (limit {EXPERTS_TOLERANCE:g})")


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
