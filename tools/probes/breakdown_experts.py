"""Where each experts call's GPU time goes, kernel by kernel, timed as the benchmark times it.

    python3 tools/probes/breakdown_experts.py [--shapes I:L:T ...] [--json F]

For each shape the library's :class:`dbo.experts.SwiGLUExperts` (device offsets, as the experts
grid) is called ``--steps`` times, each call queued behind a GPU sleep (the benchmark's "GPU
time"), under torch.profiler. From the trace, per call: the span from its first kernel's start
to its last kernel's end, the kernels' summed time, the gaps (span - sum), and each kernel's
mean time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dbo.bench.experts.command import apply_experts, make_case
from dbo.bench.limits import experts_cost, measure_device_limits
from dbo.bench.timing import gpu_sleep
from dbo.experts import SwiGLUExperts
from dbo.moe import Workspace

SHAPES = ["256:32:1024", "256:32:4096", "256:32:8192", "256:32:16384", "256:32:32768", "256:128:1024",
          "256:128:8192", "256:256:2048", "256:256:16384", "768:32:4096", "768:32:8192", "768:256:8192",
          "768:256:65536", "2048:32:8192", "2048:256:4096", "2048:256:8192"]
SLEEP = "spin_kernel"  # torch.cuda._sleep's kernel


def _kernels(trace: str) -> list[tuple[str, float, float]]:
    with open(trace) as f:
        ev = json.load(f)["traceEvents"]
    ks = [(e["name"], float(e["ts"]), float(e["dur"])) for e in ev if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda k: k[1])


def profile_calls(fn, steps: int, lead_ms: float) -> dict:
    """``fn`` ``steps`` times behind GPU sleeps, profiled: per call span, kernel sum, gaps (us),
    and each kernel's mean time (us)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gpu_sleep(lead_ms)
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        ks = _kernels(f.name)
    calls, cur = [], None
    for name, ts, dur in ks:
        if SLEEP in name:
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((name, ts, dur))
    if not any(calls):
        raise RuntimeError(f"no calls found between {SLEEP!r} kernels; kernels seen: "
                           f"{sorted({k[0][:60] for k in ks})[:20]}")
    spans, sums, per = [], [], defaultdict(list)
    for c in calls:
        if not c:
            continue
        spans.append(c[-1][1] + c[-1][2] - c[0][1])
        sums.append(sum(k[2] for k in c))
        seen = defaultdict(float)
        for name, _, dur in c:
            seen[name.split("(")[0][:48]] += dur
        for name, dur in seen.items():
            per[name].append(dur)
    span, ksum = statistics.median(spans), statistics.median(sums)
    return {"span_us": span, "kernel_sum_us": ksum, "gaps_us": span - ksum, "launches": len(calls[0]),
            "kernels_us": {n: statistics.median(v) for n, v in per.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=SHAPES, metavar="I:L:T")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    limits = measure_device_limits()
    print(limits.describe(), flush=True)
    impls = {"library": SwiGLUExperts(num_global_experts=256)}
    rows = []
    for shape in args.shapes:
        inter, local, tokens = map(int, shape.split(":"))
        case = make_case(tokens, 7168, inter, local, seed=tokens)
        pairs = int(case.counts.sum())
        flops, nbytes = experts_cost(hidden=7168, intermediate=inter, local_pairs=pairs,
                                     experts_with_rows=int((case.counts > 0).sum()))
        limit_us = 1e3 * limits.time_ms(flops, nbytes)
        row = {"shape": shape, "pairs": pairs, "limit_us": limit_us, "results": {}}
        for name, experts in impls.items():
            ws = Workspace()
            with torch.inference_mode():
                r = profile_calls(lambda e=experts, w=ws, c=case: apply_experts(e, c, False, w), args.steps,
                                  lead_ms=max(0.3, 3 * limit_us / 1e3))
            row["results"][name] = r
            ks = ", ".join(f"{n} {v:.1f}" for n, v in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1]))
            print(f"I={inter} L={local} T={tokens} {name}: span {r['span_us']:.1f} us "
                  f"({r['span_us'] / limit_us:.2f}x limit {limit_us:.1f}), kernels {r['kernel_sum_us']:.1f}, "
                  f"gaps {r['gaps_us']:.1f} over {r['launches']} launches | {ks}", flush=True)
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": limits.as_dict(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
