"""Per-shape tile sweep of the fused experts over the issue's grid, on the GPU host.

For each shape (hidden 7168, top-8 of 256, I, local experts, tokens; device offsets, as
``python -m dbo.bench experts`` runs the library) it times, queued behind a GPU sleep (the GPU's
time):

* every gate/up candidate tile alone, one program per tile and persistent;
* every down candidate tile with the top-k sum after it (the sum skips the tokens whose only
  local slot the flat tile wrote, so the two are timed together);
* then the whole call two ways (``dbo.bench.experts.time_experts``: alternating, each queued
  behind a GPU sleep): the library as it is (``SwiGLUExperts``, which may run the unfused steps)
  and the fused call with the shape's best two tiles and the library's estimate of the rows per
  expert, whose output is checked against the library's.

It prints per shape the library's picks and the best tiles (time over the pick's), the whole
call's ratio (best tiles / library), and at the end the geometric mean of that ratio by I and
over the grid: how much a per-shape tile table can gain.

    python3 tests/gpu/sweep_tiles.py --json $OUT/sweep.json [--intermediate 256] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo.bench.experts import make_case, time_experts  # noqa: E402
from dbo.bench.limits import experts_cost, measure_device_limits  # noqa: E402
from dbo.bench.timing import gpu_sleep  # noqa: E402
from dbo.moe import SwiGLUExperts  # noqa: E402
from dbo.moe.fused_experts import (  # noqa: E402
    GemmConfig,
    fused_swiglu_experts,
    launch_down,
    launch_gate_up,
    launch_topk_sum,
    pick_configs,
    route_order,
)
from dbo.moe.fused_tiles import FLAT_DOWN, FLAT_DOWN_WIDE, prefer_persistent, prefer_sole  # noqa: E402

C = GemmConfig
#: gate/up candidates (each also tried one program per tile and persistent)
UP = [C(64, 128, 64, 8, 4, 4, tma=True), C(64, 128, 64, 8, 4, 5, tma=True),
      C(64, 128, 64, 16, 4, 4, tma=True), C(128, 128, 64, 8, 8, 4, tma=True, tail_m=32),
      C(128, 128, 64, 8, 8, 3, tma=True, tail_m=32), C(128, 128, 64, 16, 8, 4, tma=True, tail_m=32),
      C(128, 128, 64, 4, 8, 4, tma=True, tail_m=32), C(128, 128, 64, 8, 8, 4, tma=True)]
UP_SMALL_I = [C(64, 64, 64, 8, 4, 4), C(64, 64, 64, 8, 4, 4, tma=True)]  # I <= 256, few experts
#: down candidates: the flat tiles (persistent always), the K-loop tiles (both ways)
DOWN_FLAT = [FLAT_DOWN, FLAT_DOWN_WIDE, C(128, 128, 64, 16, 4, 3, flat=True),
             C(128, 128, 64, 4, 4, 3, flat=True), C(64, 256, 64, 8, 4, 3, flat=True)]
DOWN_LOOP = [C(128, 256, 64, 8, 8, 4, tma=True, tail_m=16), C(128, 128, 64, 8, 4, 5, tma=True, tail_m=32)]
DOWN_SHORT = [C(64, 64, 256, 8, 4, 3, n_per_program=8), C(64, 64, 256, 8, 4, 4, n_per_program=16)]


class FixedTiles:
    """``fused_swiglu_experts`` with fixed tiles and the library's estimate of the rows per expert,
    as an experts object (its ``apply``), so that :func:`dbo.bench.experts.time_experts` times it
    (alternating with the others, each call queued behind a GPU sleep)."""

    def __init__(self, configs: tuple, rows_per_expert: float):
        self.configs, self.rows_per_expert = configs, rows_per_expert

    def apply(self, x, w1, w2, topk_weights, topk_ids, *, workspace, **_):
        out = workspace.get("fused_out", tuple(x.shape), x.dtype, x.device)
        return fused_swiglu_experts(x, w1, w2, topk_weights, topk_ids, out=out, configs=self.configs,
                                    rows_per_expert=self.rows_per_expert)


def both_ways(cfgs: list[GemmConfig]) -> list[GemmConfig]:
    return [dataclasses.replace(c, persistent=p) for c in cfgs for p in (False, True)]


def name(c: GemmConfig) -> str:
    s = f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"
    s += " tma" * c.tma + f" tail{c.tail_m}" * bool(c.tail_m) + " flat" * c.flat
    s += f" npp{c.n_per_program}" * bool(c.n_per_program)
    return s + {None: " (policy)", True: " pers", False: " grid"}[c.persistent]


def timed(fn, reps: int, lead_ms: float) -> float:
    """Median of ``reps`` back-to-back calls queued behind a GPU sleep."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    gpu_sleep(lead_ms)
    ev[0].record()
    for i in range(reps):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))


def host_lead(fn, reps: int) -> float:
    """Run ``fn`` once (compiles), then a GPU sleep long enough to cover ``reps`` launches."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return min(20.0, max(0.1, 2e3 * host * reps))


def time_candidate(fn, reps: int) -> float:
    try:
        lead = host_lead(fn, reps)
    except triton.runtime.errors.OutOfResources as e:
        print(f"  skipped: {e}", flush=True)
        return float("inf")
    return timed(fn, reps, lead)


def grid_args(p: argparse.ArgumentParser) -> None:
    """The grid's arguments, shared with ``ab_tiles.py``."""
    p.add_argument("--intermediate", type=int, nargs="+", default=[256, 768, 2048])
    p.add_argument("--local-experts", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024 << i for i in range(7)])
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this")
    p.add_argument("--json", default=None)


def run_shapes(a: argparse.Namespace, shape_fn) -> list[dict]:
    """``shape_fn(case, inter, n_local, tokens, topk, hidden, library, limits)`` for every shape of
    the grid (weights made once per I and local experts); the rows, also written to ``--json``
    after every shape (a run cut short still leaves them)."""
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    hidden, topk, rows, t0 = 7168, 8, [], time.monotonic()
    lib = SwiGLUExperts(num_global_experts=256)
    with torch.inference_mode():
        for inter in a.intermediate:
            for n_local in a.local_experts:
                w = None
                for t in a.tokens:
                    if time.monotonic() - t0 > a.budget_s:
                        print(f"budget spent: stopping before I={inter} L={n_local} T={t}", flush=True)
                        break
                    case = make_case(t, hidden, inter, n_local, seed=t, weights=w)
                    w = (case.w1, case.w2)
                    rows.append(shape_fn(case, inter, n_local, t, topk, hidden, lib, lim))
                    if a.json:
                        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))
                    del case
                del w
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    grid_args(p)
    p.add_argument("--reps", type=int, default=5, help="calls per candidate")
    p.add_argument("--steps", type=int, default=10, help="whole calls per way")
    a = p.parse_args()
    summary(run_shapes(a, lambda *shape: sweep_shape(*shape, a)))
    return 0


def sweep_shape(case, inter, n_local, t, topk, hidden, lib, lim, a) -> dict:
    pairs_bound = t * topk
    est_pairs = max(1, round(pairs_bound * n_local / 256))  # as SwiGLUExperts estimates them
    est = est_pairs / n_local
    persist = prefer_persistent(est, pairs_bound, n_local)
    sole = prefer_sole(est_pairs / pairs_bound, topk)
    up_pick, down_pick = pick_configs(est, inter, n_local)
    order, offsets = route_order(case.ids, n_local)
    act = torch.empty(pairs_bound, inter, dtype=case.x.dtype, device="cuda")
    y = torch.empty(pairs_bound, hidden, dtype=case.x.dtype, device="cuda")
    out = torch.empty_like(case.x)
    ids, tw = case.ids.contiguous(), case.weights.contiguous()

    ups = [up_pick] + both_ways(UP + (UP_SMALL_I if inter <= 256 and n_local <= 64 else []))
    downs = [down_pick] + DOWN_FLAT + both_ways(DOWN_LOOP + (DOWN_SHORT if inter <= 256 else []))
    res = {"I": inter, "L": n_local, "tokens": t, "pairs": int(case.counts.sum()),
           "experts_with_rows": int((case.counts > 0).sum()), "up": {}, "down": {}}

    def up_fn(c):
        return lambda: launch_gate_up(case.x, order, offsets, case.w1, act, c, pairs_bound, topk, persist)

    def down_fn(c):
        def f():
            s = launch_down(act, order, offsets, case.w2, y, c, pairs_bound, persist,
                            (ids, tw, out) if sole else None)
            launch_topk_sum(y, ids, tw, out, n_local, s)
        return f

    for i, c in enumerate(ups):
        res["up"]["pick" if i == 0 else name(c)] = time_candidate(up_fn(c), a.reps)
    for i, c in enumerate(downs):
        res["down"]["pick" if i == 0 else name(c)] = time_candidate(down_fn(c), a.reps)
    bu = min(range(len(ups)), key=lambda i: list(res["up"].values())[i])
    bd = min(range(len(downs)), key=lambda i: list(res["down"].values())[i])
    best = (ups[bu], downs[bd])

    # the whole call: the library as it is against the fused call with the best tiles
    res_t = time_experts({"library": (lib, False), "best tiles": (FixedTiles(best, est), False)}, case,
                         steps=a.steps, timings=("device",))
    whole = {k: v["median_ms"] for k, v in res_t.items()}
    err = res_t["best tiles"]["rel_err"]
    flops, nbytes = experts_cost(hidden=hidden, intermediate=inter, local_pairs=res["pairs"],
                                 experts_with_rows=res["experts_with_rows"])
    limit = lim.time_ms(flops, nbytes)
    res.update(best_up=name(ups[bu]), best_down=name(downs[bd]), up_pick=name(up_pick),
               down_pick=name(down_pick), whole_ms=whole, limit_ms=limit, rel_err=float(err),
               ratio=whole["best tiles"] / whole["library"])
    up_p, down_p = res["up"]["pick"], res["down"]["pick"]
    per_e = res['pairs'] / max(1, res['experts_with_rows'])
    print(f"I={inter:>4} L={n_local:>3} T={t:>5} rows/e={per_e:>5.0f} | "
          f"up pick {up_p:.3f} best {list(res['up'].values())[bu] / up_p:.3f} [{name(ups[bu])}] | "
          f"down+sum pick {down_p:.3f} best {list(res['down'].values())[bd] / down_p:.3f} "
          f"[{name(downs[bd])}] | whole: library {whole['library']:.3f} ms "
          f"({whole['library'] / limit:.2f}x), best tiles {whole['best tiles']:.3f} ms "
          f"({whole['best tiles'] / limit:.2f}x), ratio {res['ratio']:.3f}, err {err:.1e}", flush=True)
    if not err < 2e-2:
        print("  WRONG: the best tiles' output differs from the library's", flush=True)
    return res


def summary(rows: list[dict]) -> None:
    if not rows:
        return
    gm = statistics.geometric_mean
    for i in sorted({r["I"] for r in rows}):
        sub = [r for r in rows if r["I"] == i]
        print(f"I={i}: library {gm([r['whole_ms']['library'] / r['limit_ms'] for r in sub]):.3f}x limit, "
              f"best tiles {gm([r['whole_ms']['best tiles'] / r['limit_ms'] for r in sub]):.3f}x, "
              f"ratio {gm([r['ratio'] for r in sub]):.3f} ({len(sub)} rows)")
    print(f"all: library {gm([r['whole_ms']['library'] / r['limit_ms'] for r in rows]):.3f}x limit, "
          f"best tiles {gm([r['whole_ms']['best tiles'] / r['limit_ms'] for r in rows]):.3f}x, "
          f"ratio {gm([r['ratio'] for r in rows]):.3f}, worst best-tiles row "
          f"{max(r['whole_ms']['best tiles'] / r['limit_ms'] for r in rows):.2f}x ({len(rows)} rows)",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
