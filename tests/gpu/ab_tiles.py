"""Same-run A/B of tile-table variants of the fused experts, whole calls, over the issue's grid.

Each variant is a rule ``(estimated rows per expert, I, local experts, host bound, estimated
pairs) -> (gate_up tile, down tile)``, with each tile's ``persistent`` set. For every shape
(hidden 7168, top-8 of 256, device offsets, the estimate ``SwiGLUExperts`` makes) the variants'
whole calls (``fused_swiglu_experts``) and the library's (``SwiGLUExperts``, which may run the
unfused steps) alternate, each queued behind a GPU sleep (the GPU's time), ``--steps`` rounds;
each variant's output is checked against the table's. It prints per shape each variant's time
over the table's and at the end the geometric means (by I and over the grid) of the ratio and
of the time over the limit.

    python3 tests/gpu/ab_tiles.py --json $OUT/ab_tiles.json [--variants table flat16 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo.bench.experts import time_experts  # noqa: E402
from dbo.bench.limits import experts_cost  # noqa: E402
from dbo.moe.fused_experts import GemmConfig, pick_configs  # noqa: E402
from dbo.moe.fused_tiles import DOWN_TAIL, prefer_persistent  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_tiles import FixedTiles, grid_args, run_shapes  # noqa: E402

C = GemmConfig
UP_128 = C(128, 128, 64, 8, 8, 4, tma=True, tail_m=32)
WIDE_G8 = C(128, 256, 64, 8, 8, 3, flat=True)


def _fix(cfg: GemmConfig, persistent: bool) -> GemmConfig:
    # the call's policy made explicit (the flat tile is persistent always)
    return cfg if cfg.persistent is not None or cfg.flat else dataclasses.replace(cfg, persistent=persistent)


def table(est, inter, n_local, bound, pairs):
    up, down = pick_configs(est, inter, n_local)
    p = prefer_persistent(est, bound, n_local)
    return _fix(up, p), _fix(down, p)


def pers(est, inter, n_local, bound, pairs):
    # gate/up persistent wherever the host's bound counts at least twice the expected pairs
    up, down = table(est, inter, n_local, bound, pairs)
    return dataclasses.replace(up, persistent=True) if bound >= 2 * pairs else up, down


def big(est, inter, n_local, bound, pairs):
    # above 768 rows per expert at I > 256: the 128-row gate/up tile (one program per tile); at
    # I > 1024 the K-loop down tile with few experts, the wide flat one with many
    up, down = table(est, inter, n_local, bound, pairs)
    if est > 768 and inter > 256:
        up = dataclasses.replace(UP_128, persistent=False)
        if inter > 1024:
            down = WIDE_G8 if n_local > 64 else _fix(DOWN_TAIL, prefer_persistent(est, bound, n_local))
    return up, down


def up512(est, inter, n_local, bound, pairs):
    # the 128-row gate/up tile with 32-row tails at 384-1024 rows per expert, many experts
    up, down = table(est, inter, n_local, bound, pairs)
    if 384 < est <= 1024 and n_local > 64:
        up = _fix(UP_128, prefer_persistent(est, bound, n_local))
    return up, down


def every(est, inter, n_local, bound, pairs):
    up, _ = pers(est, inter, n_local, bound, pairs)
    up2, down = big(est, inter, n_local, bound, pairs)
    up = up2 if est > 768 and inter > 256 else up
    return up, dataclasses.replace(down, group_m=16) if down.flat else down


def _two_per_sm(block_k: int, stages: int):
    # the 64x128 gate/up tile with the shared memory of two programs per SM (80 KB: fewer stages
    # or a shallower K step; 168 registers, tests/gpu/compile_check.py), where the table takes it
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        if (up.block_m, up.block_n) == (64, 128):
            up = dataclasses.replace(up, block_k=block_k, num_stages=stages)
        return up, down
    return rule


WS128 = C(128, 128, 64, 8, 8, 4, ws=True)
WS64 = C(64, 128, 64, 8, 4, 5, ws=True)


def _ws(rule):
    # the warp-specialized Gluon gate/up tile where rule(est, inter, n_local) names it
    def variant(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        ws = rule(est, inter, n_local)
        return (ws if ws is not None and inter % ws.block_n == 0 else up), down
    return variant


def _split(shares: int, few: bool):
    # the warp-specialized gate/up tiles with their last round split along K into up to `shares`
    # shares; few: also the 64-row one with few experts at I <= 256 from 256 to 1024 rows
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        if few and inter <= 256 and n_local <= 64 and 256 <= est <= 1024 and inter % WS64.block_n == 0:
            up = WS64
        return (dataclasses.replace(up, split=shares) if up.ws and shares else up), down
    return rule


def _ws_band(ws: GemmConfig, lo: float, hi: float, few_only: bool):
    # the warp-specialized gate/up tile ws where lo < estimated rows per expert <= hi (few_only:
    # with <= 64 local experts only), e.g. split, where the table takes the Triton tiles
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        if lo < est <= hi and inter % ws.block_n == 0 and (n_local <= 64 or not few_only):
            up = ws
        return up, down
    return rule


def _up_group(group_m: int, up_too: bool = True, down_too: bool = False):
    # the warp-specialized gate/up tile (up_too) and the flat down tile (down_too) with at most
    # group_m row tiles per group of their map (a group's row tiles take each column block one
    # after the other; groups never span two experts, and an expert's groups are as equal as can be)
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        up = dataclasses.replace(up, group_m=group_m) if up.ws and up_too else up
        return up, (dataclasses.replace(down, group_m=group_m) if down.flat and down_too else down)
    return rule


def _down64(stages: int, lo: float):
    # the flat down tile of 64 rows (two programs per SM) from `lo` estimated rows per expert: an
    # expert's last row tile pads at most 63 rows (at 256 rows per expert the 128-row tiles
    # compute ~2.5 tiles' rows for 2), its weight tiles read by twice as many row tiles (in one
    # group of the map, at about the same time)
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        if down.flat and est >= lo:
            down = dataclasses.replace(down, block_m=64, num_stages=stages)
        return up, down
    return rule


def _few(ws: GemmConfig, max_inter: int, lo: float, hi: float):
    # with few local experts (<= 64) at I <= max_inter and lo < estimated rows per expert <= hi,
    # the warp-specialized gate/up tile ws (e.g. the 128-row one split where the 64-row split one
    # runs: half the weight tiles streamed per row, ~2.2 rounds of tiles where there were ~4.1)
    def rule(est, inter, n_local, bound, pairs):
        up, down = table(est, inter, n_local, bound, pairs)
        if n_local <= 64 and inter <= max_inter and lo < est <= hi and inter % ws.block_n == 0:
            up = ws
        return up, down
    return rule


VARIANTS = {"table": table, "fd64s3": _down64(3, 192), "fd64s4": _down64(4, 192),
            "f128s4": _few(dataclasses.replace(WS128, split=4), 256, 192, 1024),
            "f128s8": _few(dataclasses.replace(WS128, split=8), 256, 192, 1024),
            "a128s4": _few(dataclasses.replace(WS128, split=4), 1 << 20, 192, 1024),
            "f64s8": _few(dataclasses.replace(WS64, split=8), 256, 192, 1024),
            "f128s4all": _few(dataclasses.replace(WS128, split=4), 256, 192, 1 << 30),
            **{f"upg{g}": _up_group(g) for g in (4, 16, 32, 64)},
            **{f"dng{g}": _up_group(g, False, True) for g in (4, 16, 32, 64)},
            **{f"grp{g}": _up_group(g, True, True) for g in (4, 12, 16, 32, 64)},
            "ws64s128": _ws_band(dataclasses.replace(WS64, split=4), 96, 192, False),
            "ws64s128few": _ws_band(dataclasses.replace(WS64, split=4), 96, 192, True),
            "ws128s128": _ws_band(dataclasses.replace(WS128, split=4), 96, 192, False),
            "ws64s64": _ws_band(dataclasses.replace(WS64, split=4), 48, 96, False),
            "ws128s64": _ws_band(dataclasses.replace(WS128, split=4), 48, 96, False),
            "ws128_64": _ws_band(WS128, 48, 96, False),
            "ws128_128": _ws_band(WS128, 96, 192, False),
            "ws128s8_128": _ws_band(dataclasses.replace(WS128, split=8), 96, 192, False),
            "ws128s256": _ws_band(dataclasses.replace(WS128, split=4), 192, 384, False),
            "ws128s512": _ws_band(dataclasses.replace(WS128, split=4), 384, 1024, False),
            "ws64few": _split(0, True), "split4": _split(4, False),
            "split4few": _split(4, True), "split8few": _split(8, True),
            "ws256": _ws(lambda e, i, n: WS128 if e >= 256 else None),
            "ws512": _ws(lambda e, i, n: WS128 if e >= 512 else None),
            "ws64": _ws(lambda e, i, n: WS64 if e >= 256 else None),
            "wsmix": _ws(lambda e, i, n: WS128 if e >= 512 else WS64 if e >= 256 else None),
            # (flat1-16: earlier sessions' names of dng1-16)
            # flat1-16: the flat down tile's groups (the names of earlier sessions' runs; dng alike)
            **{f"flat{g}": _up_group(g, False, True) for g in (1, 2, 4, 16)},
            "pers": pers, "big": big, "up512": up512,
            "every": every, "up2": _two_per_sm(64, 2), "upk32": _two_per_sm(32, 4)}


def main() -> int:
    p = argparse.ArgumentParser()
    grid_args(p)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    if a.variants[0] != "table":
        a.variants.insert(0, "table")
    summary(run_shapes(a, lambda *shape: ab_shape(*shape, a.variants, a.steps)), a.variants)
    return 0


def ab_shape(case, inter, n_local, t, topk, hidden, lib, lim, variants, steps) -> dict:
    bound = t * topk
    pairs = max(1, round(bound * n_local / 256))  # as SwiGLUExperts estimates them
    est = pairs / n_local
    impls, tiles = {}, {}
    for v in variants:  # "table" first: the others' outputs are checked against its
        cfgs = VARIANTS[v](est, inter, n_local, bound, pairs)
        tiles[v] = [str(c) for c in cfgs]
        impls[v] = (FixedTiles(cfgs, est), False)
    impls["library"] = (lib, False)
    res = time_experts(impls, case, steps=steps, timings=("device",))
    ms = {k: v["median_ms"] for k, v in res.items()}
    errs = {v: res[v]["rel_err"] for v in variants}
    flops, nbytes = experts_cost(hidden=hidden, intermediate=inter, local_pairs=int(case.counts.sum()),
                                 experts_with_rows=int((case.counts > 0).sum()))
    limit = lim.time_ms(flops, nbytes)
    print(f"I={inter:>4} L={n_local:>3} T={t:>5} rows/e={est:>5.0f} | table {ms['table']:.3f} ms "
          f"({ms['table'] / limit:.2f}x) | " + " ".join(
              f"{k} {ms[k] / ms['table']:.3f}" for k in ms if k != "table")
          + ("" if max(errs.values()) < 2e-2 else f" | WRONG {errs}"), flush=True)
    return {"I": inter, "L": n_local, "tokens": t, "est_rows": est, "limit_ms": limit, "ms": ms,
            "errs": errs, "tiles": tiles}


def summary(rows: list[dict], variants: list[str]) -> None:
    if not rows:
        return
    gm = statistics.geometric_mean
    names = ["library"] + variants
    for i in sorted({r["I"] for r in rows}) + [None]:
        sub = [r for r in rows if i is None or r["I"] == i]
        print(("all" if i is None else f"I={i}") + f" ({len(sub)} rows): " + "; ".join(
            f"{k} {gm([r['ms'][k] / r['limit_ms'] for r in sub]):.3f}x limit, "
            f"{gm([r['ms'][k] / r['ms']['table'] for r in sub]):.3f} of table" for k in names), flush=True)
    for k in names:
        worst = max(rows, key=lambda r: r["ms"][k] / r["limit_ms"])
        print(f"{k}: worst {worst['ms'][k] / worst['limit_ms']:.2f}x (I={worst['I']} L={worst['L']} "
              f"T={worst['tokens']}), rows over 2.0: {sum(r['ms'][k] / r['limit_ms'] > 2 for r in rows)}")


if __name__ == "__main__":
    sys.exit(main())
