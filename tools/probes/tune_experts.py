"""Tile sweep of the fused experts' two grouped GEMMs (dbo.experts.kernels.fused_experts) on the GPU host.

For each shape (hidden 7168, top-8 of 256, I, local experts, tokens) it times every candidate
tile of the gate/up GEMM and of the down GEMM alone (CUDA events, median), checks each
candidate's output against the unfused reference on the first shape, and prints per shape the
best tile, its time and its ratio to the GEMM's own limit (bandwidth and GEMM rate measured at
the start of the run). The chosen tiles go into ``dbo.experts.kernels.fused_experts.CONFIGS``.

    python tools/probes/tune_experts.py --json $OUT/tune.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo.bench import timing  # noqa: E402
from dbo.bench.experts.command import make_case  # noqa: E402
from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.bench.timing import gpu_sleep  # noqa: E402
from dbo.experts import SwiGLUExperts, relative_error  # noqa: E402
from dbo.experts.kernels.fused_experts import (  # noqa: E402
    GemmConfig,
    fused_swiglu_experts,
    launch_down,
    launch_gate_up,
    pick_configs,
    route_order,
)
from dbo.experts.kernels.fused_maps import MAP_GROUP_M  # noqa: E402
from dbo.experts.kernels.fused_tiles import prefer_persistent  # noqa: E402
from dbo.moe import ActivationFormat, Workspace  # noqa: E402

C = GemmConfig
UP = [C(64, 64, 64, 8, 4, 4), C(128, 128, 64, 8, 8, 4), C(128, 128, 64, 8, 8, 3),
      C(64, 64, 64, 8, 4, 4, tma=True), C(64, 128, 64, 8, 8, 4, tma=True),
      C(128, 64, 64, 8, 8, 4, tma=True), C(128, 128, 64, 8, 8, 3, tma=True),
      C(128, 128, 64, 8, 8, 4, tma=True), C(128, 64, 128, 8, 8, 3, tma=True),
      C(128, 128, 32, 8, 8, 6, tma=True), C(64, 128, 64, 8, 4, 5, tma=True),
      C(128, 64, 64, 8, 4, 5, tma=True), C(64, 128, 64, 8, 4, 4, tma=True),
      C(64, 256, 64, 8, 8, 3, tma=True), C(64, 64, 128, 8, 4, 3, tma=True),
      C(64, 128, 64, 4, 4, 5, tma=True),
      # an expert's last tile as a 32-row (or half) tile when its rows fit
      C(128, 128, 64, 8, 8, 4, tma=True, tail_m=32), C(128, 128, 64, 8, 8, 3, tma=True, tail_m=32),
      C(128, 128, 32, 8, 8, 6, tma=True, tail_m=32), C(64, 128, 64, 8, 4, 5, tma=True, tail_m=32),
      C(64, 128, 64, 8, 4, 4, tma=True, tail_m=16), C(128, 128, 64, 8, 8, 4, tma=True, tail_m=16),
      C(128, 256, 64, 8, 8, 3, tma=True, tail_m=32),
      # narrower tiles: more programs where few experts get a few hundred rows (I <= 256)
      C(64, 64, 64, 8, 4, 5, tma=True), C(128, 64, 64, 8, 8, 4, tma=True, tail_m=32),
      C(64, 32, 128, 8, 4, 4, tma=True), C(128, 32, 64, 8, 4, 5, tma=True)]
#: gate/up tiles of which two programs fit on an SM (tools/probes/compile_check.py: 64-96 KB of
#: shared memory, <= 229 registers at four warps)
UP_TWO_PER_SM = [C(128, 64, 64, 8, 4, 3, tma=True), C(128, 64, 64, 8, 4, 2, tma=True),
                 C(64, 128, 64, 8, 4, 2, tma=True), C(128, 64, 64, 8, 4, 3, tma=True, tail_m=32)]
#: gate/up tiles that read each weight tile for more rows (128-256 rows: half or a quarter of the
#: 64-row tile's weight traffic through L2, which Nsight Compute finds at 87-92% of its
#: throughput with the 64-row tile at 256-512 rows per expert; tools/probes/compile_check.py: no
#: spills)
UP_WIDE = [C(128, 128, 64, 8, 8, 4, tma=True, tail_m=32), C(128, 128, 64, 8, 8, 3, tma=True, tail_m=32),
           C(128, 128, 32, 8, 8, 6, tma=True, tail_m=32), C(256, 64, 64, 8, 8, 4, tma=True),
           C(256, 64, 64, 8, 8, 3, tma=True), C(256, 64, 64, 8, 8, 4, tma=True, tail_m=64),
           C(256, 32, 64, 8, 8, 5, tma=True), C(128, 64, 64, 8, 8, 5, tma=True, tail_m=32),
           C(128, 64, 64, 8, 4, 4, tma=True, tail_m=32)]
DOWN = [C(64, 128, 64, 8, 4, 4), C(128, 128, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 4),
        C(64, 128, 64, 8, 4, 4, tma=True), C(128, 128, 64, 8, 8, 4, tma=True),
        C(128, 256, 64, 8, 8, 3, tma=True), C(128, 256, 64, 8, 8, 4, tma=True),
        C(128, 128, 128, 8, 8, 3, tma=True), C(128, 256, 32, 8, 8, 6, tma=True),
        C(128, 128, 64, 8, 4, 5, tma=True), C(64, 256, 64, 8, 8, 5, tma=True),
        C(64, 256, 64, 8, 4, 4, tma=True), C(64, 128, 128, 8, 4, 3, tma=True),
        C(64, 64, 64, 8, 4, 6, tma=True),
        C(128, 256, 64, 8, 8, 4, tma=True, tail_m=32), C(128, 256, 64, 8, 8, 3, tma=True, tail_m=32),
        C(128, 256, 32, 8, 8, 6, tma=True, tail_m=32), C(64, 256, 64, 8, 8, 5, tma=True, tail_m=32),
        C(128, 128, 64, 8, 4, 5, tma=True, tail_m=32), C(128, 256, 64, 8, 8, 4, tma=True, tail_m=16)]
SHORT_K = [C(64, 128, 256, 8, 4, 2, n_per_program=8), C(128, 64, 256, 8, 4, 3, n_per_program=16),
           C(64, 64, 256, 8, 4, 3, n_per_program=8), C(64, 128, 256, 8, 4, 3, n_per_program=4),
           C(128, 128, 256, 8, 8, 2, n_per_program=8), C(64, 64, 256, 8, 4, 4, n_per_program=16),
           C(128, 64, 256, 8, 4, 3, n_per_program=4),
           # small enough for two programs per SM (shared memory <= ~110 KB)
           C(128, 32, 256, 8, 4, 3, n_per_program=32), C(64, 64, 256, 8, 4, 2, n_per_program=16),
           C(64, 32, 256, 8, 4, 3, n_per_program=32), C(128, 64, 256, 8, 4, 2, n_per_program=16)]
#: the persistent down kernel with its tile loop flattened into the K loop (any I)
FLAT = [C(128, 256, 64, 8, 8, 3, flat=True), C(128, 128, 64, 8, 4, 4, flat=True),
        C(64, 256, 64, 8, 4, 4, flat=True),
        # two programs per SM (shared memory <= ~110 KB, registers <= 256 per thread at 4 warps:
        # tools/probes/compile_check.py), so that one's stores overlap the other's products
        C(64, 256, 64, 8, 4, 2, flat=True), C(128, 128, 64, 8, 4, 2, flat=True),
        C(128, 128, 64, 8, 4, 3, flat=True), C(64, 128, 64, 8, 4, 3, flat=True),
        C(64, 128, 64, 8, 4, 2, flat=True)]
DOWN += FLAT


def median_ms(fn, reps: int) -> float:
    try:
        fn()
    except triton.runtime.errors.OutOfResources as e:  # a tile too large for shared memory
        print(f"  skipped: {e}", flush=True)
        return float("inf")
    return timing.median_ms(fn, steps=reps, warmup=0, device="cuda")


def alternating_ms(fns: dict, reps: int, rotate: bool = False, sleep_each_ms: float = 0.0) -> dict:
    """Median ms of each callable, their calls alternating round by round behind a GPU sleep
    (``rotate``: each round starting at the next callable, so that none always runs first;
    ``sleep_each_ms``: a sleep of that long before each call too, so that the host's launches of
    many short calls in a round stay ahead of the GPU)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    names = list(fns)
    for i in range(reps):
        gpu_sleep(0.3)
        ev = {}
        shift = i % len(names) if rotate else 0
        for k in names[shift:] + names[:shift]:
            f = fns[k]
            if sleep_each_ms:
                gpu_sleep(sleep_each_ms)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            ev[k] = (a, b)
        torch.cuda.synchronize()
        for k, (a, b) in ev.items():
            times[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in times.items()}


def down_probe_inputs(lim, inter: int, local: int, t: int, hidden: int = 7168, topk: int = 8):
    """The down GEMM's inputs for a grid shape as the library makes them (device offsets, the
    gate/up GEMM with the library's tile), for the down-kernel probes: ``(case, order, offsets,
    the library's down tile, act, persistent, row)``, ``row`` the shape, its local pairs and the
    down GEMM's own limit in ms (its flops; its weights, ``act`` and ``y``'s bytes)."""
    case = make_case(t, hidden, inter, local, seed=t)
    pairs = int(case.counts.sum())
    active = int((case.counts > 0).sum())
    est = t * topk / 256  # as the library estimates without host counts
    order, offsets = route_order(case.ids, local)
    up, down = pick_configs(est, inter, local)
    act = torch.empty(t * topk, inter, dtype=case.x.dtype, device="cuda")
    persist = prefer_persistent(est, t * topk, local)
    launch_gate_up(case.x, order, offsets, case.w1, act, up, t * topk, topk, persist)
    w_bytes = active * hidden * inter * 2
    own = lim.time_ms(2.0 * pairs * hidden * inter, w_bytes + pairs * inter * 2 + pairs * hidden * 2)
    return case, order, offsets, down, act, persist, {"I": inter, "L": local, "T": t, "pairs": pairs,
                                                       "limit_ms": own}


def host_map(tiles_by_expert: list[list[tuple[int, int, int]]], group_m: int = MAP_GROUP_M,
             device: str = "cuda") -> torch.Tensor:
    """A row-tile map built on the host, for the probes whose maps the library does not build:
    from each expert's row tiles ``(expert, first row, end row)`` in order, fused_maps' format
    (``[count]``, then per tile those three, its group's first tile and the group's size), an
    expert's tiles in groups of at most ``group_m`` of as equal sizes as can be (as
    ``fused_maps.map_tiles`` groups them)."""
    flat, count = [], 0
    for tiles in tiles_by_expert:
        n = len(tiles)
        g = max(1, -(-n // group_m))
        firsts = [-(-i * n // g) for i in range(g + 1)]
        for i, tile in enumerate(tiles):
            c = i * g // n
            flat += [*tile, count + firsts[c], firsts[c + 1] - firsts[c]]
        count += n
    return torch.tensor([count, *flat], dtype=torch.int32, device=device)


def probe_shapes(shapes, one_shape, line=None, reps: int = 20, limits: bool = False, summary=None) -> int:
    """A probe's main over ``(I, local experts, tokens)`` shapes: ``--json`` (the rows), ``--reps``
    (default ``reps``). ``one_shape(I, L, T, reps)`` returns a row, or with ``limits``
    ``one_shape(lim, I, L, T, reps)``, ``lim`` the device's ceilings measured first (printed, and
    kept in the json); ``line(row)``, where given, is printed after each shape, and
    ``summary(rows)`` after the last."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--shapes", nargs="+", metavar="I:L:T", help="instead of the probe's shapes")
    a = ap.parse_args()
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes]
    lim = measure_device_limits() if limits else None
    if lim is not None:
        print(lim.describe(), flush=True)
    rows = []
    with torch.inference_mode():
        for inter, local, t in shapes:
            rows.append(one_shape(*(() if lim is None else (lim,)), inter, local, t, a.reps))
            if line is not None:
                print(line(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if summary is not None:
        summary(rows)
    if a.json:
        out = {"rows": rows} if lim is None else {"limits": lim.as_dict(), "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--intermediate", type=int, nargs="+", default=[256, 768, 2048])
    p.add_argument("--local-experts", type=int, nargs="+", default=[256])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 65536])
    p.add_argument("--no-check", action="store_true", help="skip the candidates' correctness check")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--up-only", action="store_true", help="time only the gate/up candidates")
    p.add_argument("--down-only", action="store_true", help="time only the down candidates")
    p.add_argument("--two-per-sm", action="store_true",
                   help="gate/up candidates: the library's pick and UP_TWO_PER_SM only")
    p.add_argument("--wide", action="store_true",
                   help="gate/up candidates: the library's pick and UP_WIDE only")
    p.add_argument("--flat", action="store_true",
                   help="down candidates: the library's pick, the short-K tiles (I <= 256) and FLAT")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.two_per_sm:
        UP[:] = UP[:1] + UP_TWO_PER_SM
    if a.wide:
        UP[:] = UP[:1] + UP_WIDE
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    hidden, topk, rows = 7168, 8, []
    with torch.inference_mode():
        for inter in a.intermediate:
            checked = a.no_check  # every candidate is checked at each intermediate size
            wrong: set[GemmConfig] = set()
            for n_local in a.local_experts:
                w = None
                for t in a.tokens:
                    case = make_case(t, hidden, inter, n_local, seed=t, weights=w)
                    w = (case.w1, case.w2)
                    pairs = int(case.counts.sum())
                    active = int((case.counts > 0).sum())
                    order, offsets = route_order(case.ids, n_local)
                    act = torch.empty(t * topk, inter, dtype=case.x.dtype, device="cuda")
                    y = torch.empty(t * topk, hidden, dtype=case.x.dtype, device="cuda")
                    if not checked:  # every candidate computes the same function
                        ref = SwiGLUExperts(fused=False).apply(
                            case.x, case.w1, case.w2, case.weights, case.ids,
                            activation_format=ActivationFormat.STANDARD, expert_tokens_meta=None,
                            apply_router_weight_on_input=False, workspace=Workspace()).clone()
                        for cu in UP[:1] if a.down_only else UP:
                            short = SHORT_K if inter <= 256 else []
                            every_down = FLAT + short if a.flat else DOWN + short
                            for cd in DOWN[:1] if cu is not UP[0] else every_down:
                                out = torch.full_like(case.x, float("nan"))
                                try:
                                    fused_swiglu_experts(case.x, case.w1, case.w2, case.weights,
                                                         case.ids, out=out, configs=(cu, cd))
                                except triton.runtime.errors.OutOfResources:
                                    continue
                                err = relative_error(out, ref)
                                if not err < 2e-2:  # reported, and left out of the timings
                                    print(f"WRONG: {cu} {cd} relative error {err}", flush=True)
                                    wrong.add(cd if cu is UP[0] else cu)
                        print("the candidates checked against the unfused experts "
                              f"({len(wrong)} wrong)", flush=True)
                        checked = True
                    up_flops = 4.0 * pairs * hidden * inter
                    w_bytes = active * hidden * inter * 2
                    up_lim = lim.time_ms(up_flops, 2 * w_bytes + t * hidden * 2 + pairs * inter * 2)
                    down_lim = lim.time_ms(up_flops / 2, w_bytes + pairs * inter * 2 + pairs * hidden * 2)
                    res = {"I": inter, "L": n_local, "tokens": t, "pairs": pairs,
                           "rows_per_expert": pairs / max(1, active), "up_limit_ms": up_lim,
                           "down_limit_ms": down_lim, "up": {}, "down": {}}
                    persist = prefer_persistent(pairs / n_local, t * topk, n_local)  # as the library
                    ups = [c for c in (UP[:1] if a.down_only else UP) if c not in wrong]
                    up_pick = pick_configs(pairs / n_local, inter, n_local)[0]
                    if up_pick not in ups:
                        ups.insert(0, up_pick)
                    for cfg in ups:
                        res["up"][str(tuple(cfg.__dict__.values()))] = median_ms(
                            lambda c=cfg, cs=case, o=order, f=offsets, ac=act, n=t * topk, ps=persist:
                            launch_gate_up(cs.x, o, f, cs.w1, ac, c, n, topk, ps), a.reps)
                    downs = DOWN + (SHORT_K if inter <= 256 else [])
                    if a.flat:
                        pick = pick_configs(pairs / n_local, inter, n_local)[1]
                        downs = [pick] + [c for c in FLAT + (SHORT_K if inter <= 256 else []) if c != pick]
                    for cfg in [] if a.up_only else [c for c in downs if c not in wrong]:
                        res["down"][str(tuple(cfg.__dict__.values()))] = median_ms(
                            lambda c=cfg, cs=case, o=order, f=offsets, ac=act, yy=y, n=t * topk, ps=persist:
                            launch_down(ac, o, f, cs.w2, yy, c, n, ps), a.reps)
                    if a.up_only:
                        res["down"] = {"-": float("nan")}
                    bu = min(res["up"], key=res["up"].get)
                    bd = min(res["down"], key=res["down"].get)
                    for g in ("up",) if a.up_only else ("up", "down"):
                        top = sorted(res[g], key=res[g].get)[:3]
                        print(f"  {g} top: " + "; ".join(f"{k} {res[g][k]:.3f}" for k in top), flush=True)
                    uk = res["up"][str(tuple(up_pick.__dict__.values()))]
                    print(f"  up: the library's pick {uk:.3f} ms ({uk / up_lim:.2f}x), best / pick "
                          f"{res['up'][bu] / uk:.3f}", flush=True)
                    if a.flat and not a.up_only:
                        pk = res["down"][str(tuple(pick.__dict__.values()))]
                        print(f"  down: the library's pick {pk:.3f} ms ({pk / down_lim:.2f}x), best / pick "
                              f"{res['down'][bd] / pk:.3f}", flush=True)
                    print(f"I={inter:>4} L={n_local:>3} T={t:>5} rows/e={res['rows_per_expert']:>6.0f} | "
                          "up best "
                          f"{res['up'][bu]:.3f} ms ({res['up'][bu] / up_lim:.2f}x) {bu} | down best "
                          f"{res['down'][bd]:.3f} ms ({res['down'][bd] / down_lim:.2f}x) {bd}", flush=True)
                    rows.append(res)
                    if a.json:  # after every shape: a run cut short still leaves its rows
                        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))
                    del act, y, order, offsets, case
                del w
                torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
