"""The warp-specialized Gluon gate/up GEMM (:mod:`dbo.moe.gluon_gate_up`) against the library's gate/up
tile, on the GPU host: the same output (the local pairs' rows of ``act``, compared bit for bit),
and each one's time (CUDA events, median) against the GEMM's own limit, per shape and variant.

    python3 tests/gpu/probe_gate_up_ws.py [--shapes I:L:T ...] [--variants BM:BN:STAGES:LW:LR:GM ...]
                                          [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import median_ms  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe import gluon_gate_up as ws  # noqa: E402

SHAPES = ["256:32:8192", "256:32:16384", "256:32:65536", "256:256:2048", "256:256:16384", "768:32:16384",
          "768:128:4096", "768:256:8192", "2048:32:65536", "2048:128:4096", "2048:256:1024", "2048:256:8192"]
#: BM:BN:STAGES:LOAD_WARPS:LOAD_REGS:GROUP_M
VARIANTS = ["128:128:4:4:64:8", "64:128:5:4:64:8"]


def one_shape(lim, shape: str, variants: list[str], reps: int) -> dict:
    inter, local, t = (int(v) for v in shape.split(":"))
    hidden, topk = 7168, 8
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    case = make_case(t, hidden, inter, local, seed=t)
    pairs = int(case.counts.sum())
    active = int((case.counts > 0).sum())
    est = t * topk / 256  # as the library estimates without host counts
    bound = t * topk
    order, offsets = fe.route_order(case.ids, local)
    up, _ = fe.pick_configs(est, inter, local)
    persist = fe.prefer_persistent(est, bound, local)
    ref = torch.zeros(bound, inter, dtype=case.x.dtype, device="cuda")

    def lib() -> None:
        fe.launch_gate_up(case.x, order, offsets, case.w1, ref, up, bound, topk, persist)

    own = lim.time_ms(2.0 * pairs * hidden * 2 * inter,
                      active * 2 * inter * hidden * 2 + pairs * hidden * 2 + pairs * inter * 2)
    r = {"shape": shape, "pairs": pairs, "limit_ms": own, "lib_ms": median_ms(lib, reps),
         "lib_tile": f"{up.block_m}x{up.block_n} w{up.num_warps} s{up.num_stages} p{int(persist)}"}
    for v in variants:
        bm, bn, stages, lw, lr, gm = (int(p) for p in v.split(":"))
        if inter % bn:
            continue
        tiles, _ = fe.tile_map(offsets, bm, bound, group_m=gm)
        out = torch.zeros_like(ref)
        kw = dict(block_m=bm, block_n=bn, stages=stages, load_warps=lw, load_regs=lr)
        # as the library sizes the grid: its tile bound, at most one program per SM
        programs = min((-(-bound // bm) + local) * (inter // bn), sms)

        def run(o: torch.Tensor = out, tl_: torch.Tensor = tiles, kw: dict = kw, p: int = programs) -> None:
            ws.launch_gate_up_ws(case.x, order, tl_, case.w1, o, topk, p, **kw)

        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported per variant
            print(f"  {v}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        r[f"ws{v}_equal"] = bool(torch.equal(out[:pairs], ref[:pairs]))
        r[f"ws{v}_maxdiff"] = float((out[:pairs].float() - ref[:pairs].float()).abs().max())
        r[f"ws{v}_ms"] = median_ms(run, reps)

        def with_map(o: torch.Tensor = out, kw: dict = kw, p: int = programs, gm: int = gm) -> None:
            tl2, _ = fe.tile_map(offsets, kw["block_m"], bound, group_m=gm)
            ws.launch_gate_up_ws(case.x, order, tl2, case.w1, o, topk, p, **kw)

        r[f"ws{v}_map_ms"] = median_ms(with_map, reps)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--variants", nargs="*", default=VARIANTS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    rows, ratios = [], {v: [] for v in a.variants}
    with torch.inference_mode():
        for s in a.shapes:
            r = one_shape(lim, s, a.variants, a.reps)
            own, lib = r["limit_ms"], r["lib_ms"]
            print(f"{s} pairs={r['pairs']} own limit {own:.3f} ms | lib {r['lib_tile']} {lib:.3f} "
                  f"({lib / own:.2f}x)", flush=True)
            for v in a.variants:
                if f"ws{v}_ms" in r:
                    ms = r[f"ws{v}_ms"]
                    ratios[v].append(ms / lib)
                    print(f"   ws {v}: {ms:.3f} ms ({ms / own:.2f}x own, {ms / lib:.3f} of lib; with map "
                          f"{r[f'ws{v}_map_ms'] / lib:.3f}) equal={r[f'ws{v}_equal']} "
                          f"maxdiff={r[f'ws{v}_maxdiff']:.3g}", flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    for v, xs in ratios.items():
        if xs:
            print(f"variant {v}: geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.3f} of lib over "
                  f"{len(xs)} shapes (min {min(xs):.3f}, max {max(xs):.3f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
