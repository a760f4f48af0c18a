"""The warp-specialized gate/up kernel with swapped products for tiles of few rows
(``launch_gate_up_ws(spill=S)``) against the same kernel without them, kernel alone, on the grid's
random routing and on a routing with exactly ``8T/256`` rows per expert (no tile of few rows:
whether the swapped products' code costs the full tiles anything), on the GPU host: whether the
activations are the same bits, and each variant's time (CUDA events, the variants alternating
round by round in a rotating order behind a GPU sleep, median).

    python3 tests/gpu/probe_spill.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_balanced import balanced_ids  # noqa: E402
from tune_experts import alternating_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe import gluon_gate_up as gg  # noqa: E402

SHAPES = [(2048, 256, 4096), (768, 128, 4096), (768, 256, 4096), (256, 256, 4096), (2048, 256, 8192),
          (768, 256, 8192)]
#: (name, block_m, stages, split, spill)
VARIANTS = [("ws128s4", 128, 4, 4, 0), ("ws128s4sp32", 128, 4, 4, 32), ("ws128", 128, 4, 0, 0),
            ("ws128sp32", 128, 4, 0, 32), ("ws64", 64, 5, 0, 0), ("ws64sp32", 64, 5, 0, 32)]


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    # (lim: measured and printed by probe_shapes, not used here)
    hidden, topk = 7168, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rand = make_case(t, hidden, inter, local, seed=t)
    bal = dataclasses.replace(rand, ids=balanced_ids(t, local, seed=t), _meta=None)
    pairs = t * topk
    r = {"I": inter, "L": local, "T": t}
    for kind, case in (("random", rand), ("balanced", bal)):
        order, offsets = fe.route_order(case.ids, local)
        maps = {bm: fe.tile_map(offsets, bm, pairs)[0] for bm in (64, 128)}
        acts, fns = {}, {}
        for name, bm, st, split, spill in VARIANTS:
            acts[name] = torch.zeros(pairs, inter, dtype=case.x.dtype, device="cuda")
            fns[name] = lambda a=acts[name], c=case, o=order, m=maps, bm=bm, st=st, sp=split, sl=spill: (
                gg.launch_gate_up_ws(c.x, o, m[bm], c.w1, a, topk, sms, block_m=bm, stages=st, split=sp,
                                     spill=sl))
        ms = alternating_ms(fns, reps, rotate=True)
        n = int((case.ids >= 0).sum())
        same = {name: bool(torch.equal(acts[name][:n], acts[name.replace("sp32", "")][:n]))
                for name, *_ in VARIANTS if name.endswith("sp32")}
        r[kind] = {"ms": ms, "same_bits": same}
    return r


def _line(r: dict) -> str:
    out = f"I={r['I']} L={r['L']} T={r['T']}"
    for kind in ("random", "balanced"):
        ms = r[kind]["ms"]
        out += (f" | {kind}: ws128s4 {ms['ws128s4']:.4f} ms, " + " ".join(
            f"{k} {v / ms['ws128s4']:.3f}" for k, v in ms.items() if k != "ws128s4")
            + f" same bits {all(r[kind]['same_bits'].values())}")
    return out


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20, limits=True))
