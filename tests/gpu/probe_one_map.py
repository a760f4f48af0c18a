"""The row-tile maps, the sole rows' marks and the split's counters built with the routing (the
counting sort's second launch: ``fused_route.route_with_maps``, the library's call, "one"), in a
launch after it (``fused_maps.tile_maps``, "maps") and in one launch each (the map of the
warp-specialized gate/up tile, its counters' memset, the flat down tile's map with the marks,
"sep"), whole calls with the library's tiles, on the GPU host: whether the outputs are the same
bits, and each path's time (CUDA events, the paths alternating round by round in a rotating
order behind a GPU sleep, median).

    python3 tests/gpu/probe_one_map.py [--json out.json] [--reps 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_experts_gpu import separate_launches as separate  # noqa: E402
from tune_experts import alternating_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe import fused_maps as fm  # noqa: E402
from dbo.moe import fused_route as fr  # noqa: E402


def _maps_after_routing(topk_ids, n_experts, block_ms, pairs, sole, zero=None, bounds=None):
    # route_with_maps as it was: the routing, then tile_maps's own launch
    order, offsets = fr.route_order(topk_ids, n_experts, bounds)
    maps, dest = fm.tile_maps(offsets, block_ms, pairs, (order, topk_ids) if sole else None, zero)
    return order, offsets, maps, dest


def _with_maps_after_routing(fn):
    def call():
        fe.route_with_maps = _maps_after_routing
        try:
            return fn()
        finally:
            fe.route_with_maps = fr.route_with_maps
    return call

#: (I, local experts, tokens): rows where the gate/up tile is warp-specialized: at 128 rows per
#: expert one map (128 rows), from 256 two (64 against the down tile's 128), split or not
SHAPES = [(768, 32, 4096), (256, 128, 4096), (2048, 256, 4096), (256, 32, 8192), (256, 32, 16384),
          (256, 32, 8192), (256, 128, 8192), (256, 128, 16384), (768, 32, 8192), (768, 32, 16384),
          (768, 128, 8192), (2048, 32, 8192), (256, 256, 8192), (2048, 256, 8192)]


def one_shape(inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case = make_case(t, hidden, inter, local, seed=t)
    pairs = t * topk * local // 256
    configs = fe.pick_configs(pairs / local, inter, local)
    ids = case.ids.contiguous()
    tw = case.weights.contiguous()
    outs = {k: torch.zeros(t, hidden, dtype=case.x.dtype, device="cuda") for k in ("one", "sep")}
    fns = {"one": lambda: fe.fused_swiglu_experts(case.x, case.w1, case.w2, tw, ids, out=outs["one"],
                                                  configs=configs, max_local_pairs=t * topk,
                                                  rows_per_expert=pairs / local, persistent=True),
           "sep": lambda: separate(case.x, case.w1, case.w2, tw, ids, outs["sep"], configs, t * topk,
                                   fe.prefer_sole(local / 256, topk))}
    outs["maps"] = torch.zeros_like(outs["one"])
    fns["maps"] = _with_maps_after_routing(lambda: fe.fused_swiglu_experts(
        case.x, case.w1, case.w2, tw, ids, out=outs["maps"], configs=configs, max_local_pairs=t * topk,
        rows_per_expert=pairs / local, persistent=True))
    fns["one_again"] = fns["one"]  # a second series of the same call: the timer's own spread
    ms = alternating_ms(fns, reps, rotate=True)
    return {"I": inter, "L": local, "T": t, "tiles": [str(c) for c in configs], "ms": ms,
            "same_bits": all(torch.equal(outs["one"], outs[k]) for k in ("sep", "maps"))}


def _line(r: dict) -> str:
    ms = r["ms"]
    return (f"I={r['I']} L={r['L']} T={r['T']} up {r['tiles'][0]} | separate {ms['sep']:.4f} ms | over it: "
            f"maps after routing {ms['maps'] / ms['sep']:.3f}, with it {ms['one'] / ms['sep']:.3f} (again "
            f"{ms['one_again'] / ms['sep']:.3f}) | same bits {r['same_bits']}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=30))
