"""The warp-specialized gate/up kernel with its last round's tiles split along K
(``launch_gate_up_ws(split=S)``) against the same kernel unsplit and against the library's pick,
kernel alone, on the GPU host: the activations' largest relative difference from the unsplit
kernel's, whether two split calls give the same bits, and the time of each (CUDA events, the
variants alternating round by round behind a GPU sleep, median).

    python3 tests/gpu/probe_gate_up_split.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe import gluon_gate_up as gg  # noqa: E402

SHAPES = [(256, 32, 4096), (256, 32, 8192), (256, 32, 16384), (256, 32, 32768), (256, 128, 8192),
          (768, 32, 8192), (768, 32, 16384), (768, 128, 4096), (2048, 32, 8192), (2048, 256, 8192)]
#: (name, block_m, stages, split)
VARIANTS = [("ws64s8", 64, 5, 8), ("ws64s4", 64, 5, 4), ("ws64", 64, 5, 0), ("ws128s8", 128, 4, 8),
            ("ws128", 128, 4, 0), ("ws64s4b", 64, 5, 4)]


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    # (lim: measured and printed by probe_shapes, not used here)
    hidden, topk = 7168, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = make_case(t, hidden, inter, local, seed=t)
    est = t * topk / 256
    pairs = t * topk
    order, offsets = fe.route_order(case.ids, local)
    up, _ = fe.pick_configs(est, inter, local)
    persist = fe.prefer_persistent(est, pairs, local)
    acts, fns = {}, {}
    acts["lib"] = torch.zeros(pairs, inter, dtype=case.x.dtype, device="cuda")
    fns["lib"] = lambda a=acts["lib"]: fe.launch_gate_up(case.x, order, offsets, case.w1, a, up, pairs, topk,
                                                         persist)
    maps = {bm: fe.tile_map(offsets, bm, pairs)[0] for bm in (64, 128)}
    for name, bm, st, split in VARIANTS:
        acts[name] = torch.zeros(pairs, inter, dtype=case.x.dtype, device="cuda")
        fns[name] = lambda a=acts[name], bm=bm, st=st, sp=split: gg.launch_gate_up_ws(
            case.x, order, maps[bm], case.w1, a, topk, sms, block_m=bm, stages=st, split=sp)
    ms = alternating_ms(fns, reps)
    n = int(case.counts.sum())
    r = {"I": inter, "L": local, "T": t, "pairs": n, "lib_tile": str(up), "ms": ms}
    for name, bm, _, split in VARIANTS:
        if split:
            base = acts["ws64" if bm == 64 else "ws128"][:n].float()
            got = acts[name][:n].float()
            r[f"{name}_rel"] = float((got - base).norm() / base.norm())
            again = torch.zeros_like(acts[name])
            fns[name](again)
            r[f"{name}_same_bits"] = bool(torch.equal(again, acts[name]))
    r["ws_vs_lib_equal"] = bool(torch.equal(acts["ws64"][:n], acts["lib"][:n]))
    return r


def _line(r: dict) -> str:
    ms = r["ms"]
    checks = " ".join(f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in r.items() if k.endswith(("_rel", "_same_bits", "_equal")))
    return (f"I={r['I']} L={r['L']} T={r['T']} lib {ms['lib']:.4f} ms | "
            + " ".join(f"{k} {v / ms['lib']:.3f}" for k, v in ms.items() if k != "lib") + f" | {checks}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20, limits=True))
