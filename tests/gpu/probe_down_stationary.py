"""The weight-stationary down GEMM (tests/gpu/down_stationary_experiment.py) against the library's
down tile at I=256, kernel alone, on the GPU host: the same rows (max difference, and whether the
bits are equal), and the time of each (CUDA events, the variants' calls alternating round by
round behind a GPU sleep, median), against the GEMM's own limit. With and without the sole rows.

    python3 tests/gpu/probe_down_stationary.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import down_stationary_experiment as ds  # noqa: E402
from tune_experts import alternating_ms, down_probe_inputs, probe_shapes  # noqa: E402

from dbo.bench.limits import DeviceLimits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(256, 32, 4096), (256, 32, 8192), (256, 32, 16384), (256, 32, 65536), (256, 128, 8192),
          (256, 128, 16384), (256, 128, 65536), (256, 256, 2048), (256, 256, 8192), (256, 256, 16384)]
#: (block_m, block_n, warps, stages)
VARIANTS = [(64, 128, 4, 1), (64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 1), (64, 256, 8, 1),
            (64, 256, 8, 2), (64, 128, 8, 1)]


def one_shape(lim: DeviceLimits, inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case, order, offsets, down, act, persist, r = down_probe_inputs(lim, inter, local, t, hidden, topk)
    r["down"] = str(down)
    ids, tw = case.ids.contiguous(), case.weights.contiguous()
    for sole in (False, True):
        outs, fns = {}, {}
        maps = fe.tile_map(offsets, down.block_m, t * topk,
                           (order, ids) if sole else None) if down.flat else None
        dest = None if maps is None else maps[1]

        def bufs():
            return (torch.zeros(t * topk, hidden, dtype=case.x.dtype, device="cuda"),
                    torch.zeros(t, hidden, dtype=case.x.dtype, device="cuda"))

        y0, o0 = bufs()
        outs["lib"] = (y0, o0)
        fns["lib"] = lambda y=y0, o=o0, sole=sole, maps=maps: fe.launch_down(
            act, order, offsets, case.w2, y, down, t * topk, persist, (ids, tw, o) if sole else None, maps)
        for bm, bn, w, st in VARIANTS:
            y1, o1 = bufs()
            name = f"st{bm}x{bn}w{w}s{st}"
            outs[name] = (y1, o1)
            fns[name] = lambda y=y1, o=o1, bm=bm, bn=bn, w=w, st=st, sole=sole, dest=dest: \
                ds.launch_down_stationary(act, order, offsets, case.w2, y, block_m=bm, block_n=bn,
                                          num_warps=w, stages=st, dest=dest,
                                          sole=(ids, tw, o) if sole else None)
        good = {}
        for k, f in fns.items():
            try:
                f()
                torch.cuda.synchronize()
                good[k] = f
            except Exception as e:  # noqa: BLE001 - reported per variant
                print(f"  {k} sole={sole}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ms = alternating_ms(good, reps)
        tag = "sole_" if sole else ""
        y0, o0 = outs["lib"]
        for k in good:
            r[f"{tag}{k}_ms"] = ms[k]
            if k != "lib":
                y1, o1 = outs[k]
                r[f"{tag}{k}_diff"] = max(float((y1.float() - y0.float()).abs().max()),
                                          float((o1.float() - o0.float()).abs().max()))
                r[f"{tag}{k}_same_bits"] = bool(torch.equal(y1, y0) and torch.equal(o1, o0))
    return r


def _line(r: dict) -> str:
    own, lines = r["limit_ms"], []
    for tag in ("", "sole_"):
        lib = r.get(f"{tag}lib_ms")
        if lib is None:
            continue
        parts = []
        for k in r:
            if k.startswith(tag + "st") and k.endswith("_ms"):
                same = r.get(k[:-3] + "_same_bits")
                diff = "" if same else f" (DIFF {r.get(k[:-3] + '_diff', -1):.3g})"
                parts.append(f"{k[len(tag):-3]} {r[k] / lib:.3f}{diff}")
        lines.append(f"I={r['I']} L={r['L']} T={r['T']} {tag or 'y '}lib {lib:.4f} ms ({lib / own:.2f}x own "
                     "limit) | " + ", ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20, limits=True))
