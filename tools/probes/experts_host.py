"""Host time against GPU time of the library's experts, per shape.

    python3 tools/probes/experts_host.py [--json out.json]

For each shape: the benchmark's time (CUDA events around each ``apply``, as ``dbo.bench
experts``), the host time of one ``apply`` (``perf_counter`` while the GPU is kept busy, so no
launch waits), the GPU time alone (a CUDA graph of ``apply``, replayed), and the host time of
each step of the fused path. A shape whose event time is near its host time and far above its
graph time is launch-bound. Each step's GPU time (a CUDA graph of it alone) is printed with
its own limit (``*_x``: the step's time over the bytes/flops limit of what it reads, writes and
computes), so a shape far from the limit shows which kernel costs it.

    python3 tools/probes/experts_host.py --grid   # the experts benchmark's 63 shapes
    python3 tools/probes/experts_host.py --no-host --shapes 256:32:16384 2048:256:8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from dbo.bench.experts.command import apply_experts, make_case
from dbo.bench.limits import experts_cost, measure_device_limits
from dbo.experts import SwiGLUExperts
from dbo.experts.kernels import fused_experts as fe
from dbo.moe import Workspace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_experts import median_ms  # noqa: E402

SHAPES = [(256, 32, 1024), (256, 32, 2048), (256, 32, 4096), (256, 32, 8192), (256, 128, 1024),
          (256, 256, 1024), (768, 32, 1024), (768, 32, 4096), (2048, 32, 1024), (2048, 32, 4096),
          (256, 256, 16384), (2048, 256, 4096)]


def _busy() -> None:
    a = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ a  # ~30 ms of queue ahead of the timed launches


def host_ms(fn, n: int = 30) -> float:
    ts = []
    for _ in range(n):
        _busy()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(ts)


def graph_ms(fn, n: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return median_ms(g.replay, n)


def fused_steps(case, inter: int, local: int, persistent: bool = False) -> dict:
    """Each step of the fused path on ``case`` (routing, gate/up, down, top-k sum) as a call
    with its inputs and outputs allocated now (the tiles the library picks for the case's rows
    per expert; ``persistent`` as :func:`dbo.experts.kernels.fused_tiles.prefer_persistent` says, or not)."""
    ids = case.ids
    m, topk = ids.shape
    order, offsets = fe.route_order(ids, local)
    pairs = m * topk
    up, down = fe.pick_configs(pairs / 256, inter, local)
    act = torch.empty(pairs, inter, dtype=case.x.dtype, device="cuda")
    out = torch.empty_like(case.x)
    y = torch.empty(pairs, case.x.shape[1], dtype=case.x.dtype, device="cuda")
    return {
        "route": partial(fe.route_order, ids, local),
        "gate_up": partial(fe.launch_gate_up, case.x, order, offsets, case.w1, act, up, pairs, topk,
                           persistent),
        "down": partial(fe.launch_down, act, order, offsets, case.w2, y, down, pairs, persistent),
        "topk_sum": partial(fe.launch_topk_sum, y, ids, case.weights, out, local),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--grid", action="store_true", help="every shape of python -m dbo.bench experts")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time columns")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="I:L:T", help="these shapes only")
    a = ap.parse_args()
    grid = [(i, L, 1024 << k) for i in (256, 768, 2048) for L in (32, 128, 256) for k in range(7)]
    shapes = grid if a.grid else SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes]
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    rows = []
    with torch.inference_mode():
        for inter, local, tokens in shapes:
            case = make_case(tokens, 7168, inter, local)
            ex = SwiGLUExperts(num_global_experts=256)
            ws = Workspace()
            fn = partial(apply_experts, ex, case, False, ws)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            m, topk = case.ids.shape
            if not fe.prefer_fused(tokens * topk / 256, inter):
                print(f"I={inter} L={local} T={tokens}: the unfused steps run here", flush=True)
                continue
            steps = fused_steps(case, inter, local)
            for f in steps.values():
                f()
            r = {"I": inter, "L": local, "T": tokens, "event_ms": median_ms(fn, 30), "graph_ms": graph_ms(fn)}
            if not a.no_host:
                r["host_ms"] = host_ms(fn)
                r.update({f"host_{k}_ms": host_ms(f) for k, f in steps.items()})
            lp, used = int(case.counts.sum()), int((case.counts > 0).sum())
            fl, nb = experts_cost(hidden=7168, intermediate=inter, local_pairs=lp, experts_with_rows=used)
            r["limit_ms"] = lim.time_ms(fl, nb)
            r["x_limit"] = r["event_ms"] / r["limit_ms"]
            w = used * 7168 * inter  # the down weights of the experts with rows, elements (gate/up: 2x)
            own = {"route": (0, 4 * 4 * m * topk),  # ids read, order written, a few passes
                   "gate_up": (4 * lp * 7168 * inter, 2 * (2 * w + lp * 7168 + lp * inter)),
                   "down": (2 * lp * 7168 * inter, 2 * (w + lp * inter + lp * 7168)),
                   "topk_sum": (0, 2 * (lp * 7168 + m * 7168))}
            for k, f in steps.items():
                r[f"gpu_{k}_ms"] = graph_ms(f)
                r[f"gpu_{k}_x"] = r[f"gpu_{k}_ms"] / lim.time_ms(*own[k])
            rows.append(r)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                  flush=True)
            del case, steps
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limits": lim.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
