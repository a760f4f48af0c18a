"""Would the flat down kernel gain from running each expert's last, short row tile as a 64-row
tile? Kernel alone, on the GPU host: the library's flat tile (128 rows, one launch over the row
tiles of every expert) against two launches of the same kernel: 128-row tiles over each expert's
rows but its last tile when that has at most ``tail`` rows, then 64-row tiles over those last
tiles. The maps are built on the host for this probe (the library would build them on the
device). Whether ``y`` is the same bits, and each path's time (CUDA events, the paths
alternating in a rotating order behind a GPU sleep, median).

    python3 tests/gpu/probe_down_tail.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, host_map, probe_shapes  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe.fused_tiles import FLAT_DOWN, GemmConfig  # noqa: E402

SHAPES = [(256, 32, 4096), (256, 32, 16384), (256, 256, 4096), (256, 256, 8192), (768, 32, 4096),
          (768, 128, 4096), (768, 256, 8192), (768, 256, 16384), (2048, 128, 4096), (2048, 256, 8192),
          (2048, 32, 16384)]
#: the 64-row flat tiles tried for the last tiles: (warps, stages)
TAILS = {"t64w4s3": (4, 3), "t64w4s4": (4, 4)}


def host_maps(counts: list[int], tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(main, tails): the 128-row tiles but each expert's last when it has <= tail rows, and
    those last tiles (each a group of its own), in the map format of fused_maps.tile_map."""
    main, tails, start = [], [], 0
    for e, c in enumerate(counts):
        end = start + c
        full, rest = divmod(c, 128)
        rows = [start + 128 * i for i in range(full)]
        if 0 < rest <= tail:
            tails.append([(e, start + 128 * full, end)])
        elif rest:
            rows.append(start + 128 * full)
        main.append([(e, r0, end) for r0 in rows])
        start = end
    return host_map(main), host_map(tails)


def one_shape(inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case = make_case(t, hidden, inter, local, seed=t)
    order, offsets = fe.route_order(case.ids, local)
    pairs = t * topk
    n = int(offsets[-1])
    act = torch.randn(pairs, inter, device="cuda").to(case.x.dtype)
    lib_map, _ = fe.tile_map(offsets, FLAT_DOWN.block_m, pairs)
    main, tails = host_maps(case.counts.tolist(), 64)
    ys = {k: torch.zeros(pairs, hidden, dtype=case.x.dtype, device="cuda") for k in ["lib", *TAILS]}
    fns = {"lib": lambda: fe.launch_down(act, order, offsets, case.w2, ys["lib"], FLAT_DOWN, pairs, True,
                                         None, (lib_map, None))}
    for name, (warps, stages) in TAILS.items():
        cfg = GemmConfig(64, 128, 64, 8, warps, stages, flat=True)

        def two(y=ys[name], cfg=cfg):
            fe.launch_down(act, order, offsets, case.w2, y, FLAT_DOWN, pairs, True, None, (main, None))
            fe.launch_down(act, order, offsets, case.w2, y, cfg, pairs, True, None, (tails, None))
        fns[name] = two
    fns["lib_again"] = fns["lib"]
    ms = alternating_ms(fns, reps, rotate=True)
    rows = order[:n].long()
    same = {k: bool(torch.equal(ys[k][rows], ys["lib"][rows])) for k in TAILS}
    return {"I": inter, "L": local, "T": t, "main_tiles": int(main[0]), "tail_tiles": int(tails[0]),
            "lib_tiles": int(lib_map[0]), "ms": ms, "same_bits": same}


def _line(r: dict) -> str:
    ms = r["ms"]
    tails = " ".join(f"{k} {ms[k] / ms['lib']:.3f}" for k in TAILS)
    return (f"I={r['I']} L={r['L']} T={r['T']} row tiles {r['lib_tiles']} -> {r['main_tiles']} + "
            f"{r['tail_tiles']} | flat {ms['lib']:.4f} ms (again {ms['lib_again'] / ms['lib']:.3f}) | "
            f"{tails} | same bits {r['same_bits']}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20))
