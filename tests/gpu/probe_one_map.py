"""One launch for both GEMMs' row-tile maps, the sole rows' marks and the split's counters
(``fused_experts.tile_maps``) against one launch each (the map of the warp-specialized gate/up
tile, its counters' memset, the flat down tile's map with the marks), whole calls with the
library's tiles, on the GPU host: whether the outputs are the same bits, and each path's time
(CUDA events, the two alternating round by round behind a GPU sleep, median).

    python3 tests/gpu/probe_one_map.py [--json out.json] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_experts_gpu import separate_launches as separate  # noqa: E402
from tune_experts import alternating_ms  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

#: (I, local experts, tokens): the rows where the gate/up tile is warp-specialized (>= 256 rows
#: per expert) and its map differs from the down tile's (64 against 128 rows), split or not
SHAPES = [(256, 32, 8192), (256, 32, 16384), (256, 32, 8192), (256, 128, 8192), (256, 128, 16384),
          (768, 32, 8192), (768, 32, 16384), (768, 128, 8192), (2048, 32, 8192), (256, 256, 8192),
          (2048, 256, 8192)]


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
    fns["one_again"] = fns["one"]  # a second series of the same call: the timer's own spread
    ms = alternating_ms(fns, reps, rotate=True)
    return {"I": inter, "L": local, "T": t, "tiles": [str(c) for c in configs], "ms": ms,
            "same_bits": bool(torch.equal(outs["one"], outs["sep"]))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    rows = []
    with torch.inference_mode():
        for inter, local, t in SHAPES:
            r = one_shape(inter, local, t, a.reps)
            ms = r["ms"]
            print(f"I={inter} L={local} T={t} up {r['tiles'][0]} | separate {ms['sep']:.4f} ms, one map "
                  f"{ms['one']:.4f} ms ({ms['one'] / ms['sep']:.3f}; again "
                  f"{ms['one_again'] / ms['sep']:.3f}) | same bits {r['same_bits']}",
                  flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
