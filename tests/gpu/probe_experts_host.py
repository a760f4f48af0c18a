"""Host time against GPU time of the library's experts, per shape.

    python3 tests/gpu/probe_experts_host.py [--json out.json]

For each shape: the benchmark's time (CUDA events around each ``apply``, as ``dbo.bench
experts``), the host time of one ``apply`` (``perf_counter`` while the GPU is kept busy, so no
launch waits), the GPU time alone (a CUDA graph of ``apply``, replayed), and the host time of
each step of the fused path. A shape whose event time is near its host time and far above its
graph time is launch-bound.
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

from dbo.bench.experts import _apply, make_case
from dbo.bench.limits import experts_cost, measure_device_limits
from dbo.moe import SwiGLUExperts, Workspace
from dbo.moe import fused_experts as fe

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    rows = []
    with torch.inference_mode():
        for inter, local, tokens in SHAPES:
            case = make_case(tokens, 7168, inter, local)
            ex = SwiGLUExperts(num_global_experts=256)
            ws = Workspace()
            fn = partial(_apply, ex, case, False, ws)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            ids = case.ids
            m, topk = ids.shape
            order, offsets = fe.route_order(ids, local)
            pairs = m * topk
            up, down = fe.pick_configs(tokens * topk / 256, inter, local)
            act = torch.empty(pairs, inter, dtype=case.x.dtype, device="cuda")
            y = torch.empty(pairs, 7168, dtype=case.x.dtype, device="cuda")
            steps = {  # partials: bound now, called within this iteration
                "route": partial(fe.route_order, ids, local),
                "gate_up": partial(fe.launch_gate_up, case.x, order, offsets, case.w1, act, up, pairs, topk),
                "down": partial(fe.launch_down, act, order, offsets, case.w2, y, down, pairs),
            }
            for f in steps.values():
                f()
            r = {"I": inter, "L": local, "T": tokens, "event_ms": median_ms(fn, 30), "host_ms": host_ms(fn),
                 "graph_ms": graph_ms(fn)}
            r.update({f"host_{k}_ms": host_ms(f) for k, f in steps.items()})
            fl, nb = experts_cost(hidden=7168, intermediate=inter, local_pairs=int(case.counts.sum()),
                                  experts_with_rows=int((case.counts > 0).sum()))
            r["limit_ms"] = lim.time_ms(fl, nb)
            rows.append(r)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                  flush=True)
            del case, act, y
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limits": lim.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
