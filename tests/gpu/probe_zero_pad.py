"""Do the flat down kernel's padded rows cost power? Kernel alone, on the GPU host, run back to
back for a second or more per variant (the H200 runs such loads at its 700 W cap, so a kernel that
draws less power runs at a higher clock):

* ``lib``: the library's inputs. An expert's last 128-row tile multiplies the next expert's rows
  past its end (computed, never stored);
* ``zero``: ``act`` laid out with each expert's rows starting at a multiple of 128 and zeros
  after its end, the map in those coordinates: the same products of the real rows, and the rows
  past an expert's end are zeros;
* ``rand``: the same layout with random rows after each expert's end: the layout's own cost.

``y`` is checked bit for bit against ``lib``'s. A bf16 GEMM of 8192^3 with 25% of its first
operand's rows zero ran at 711 against 672 TFLOP/s held (1635 against 1500 MHz;
``probe_clocks.py --zero-rows``): zero operands draw less power.

    python3 tests/gpu/probe_zero_pad.py [--json out.json] [--reps 3]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, down_probe_inputs, host_map, probe_shapes  # noqa: E402

from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(2048, 256, 8192), (2048, 128, 4096), (768, 256, 8192), (768, 256, 16384), (256, 256, 16384),
          (2048, 256, 32768)]
BM = 128


def padded_map(counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The flat down map over ``act`` with each expert's rows at a multiple of ``BM`` (the map
    format of fused_maps.tile_map), and the experts' first padded rows."""
    tiles, starts, start = [], [], 0
    for e, c in enumerate(counts):
        starts.append(start)
        tiles.append([(e, start + BM * i, start + c) for i in range(-(-c // BM))])
        start += BM * len(tiles[-1])
    return host_map(tiles), starts + [start]


def sustained_ms(fn, seconds: float) -> float:
    fn()
    torch.cuda.synchronize()
    n, t0 = 0, time.time()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    while time.time() - t0 < seconds:
        for _ in range(8):
            fn()
        n += 8
        torch.cuda.synchronize()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    case, order, offsets, down, act, _, row = down_probe_inputs(lim, inter, local, t)
    pairs = t * 8
    counts = case.counts.tolist()
    n = sum(counts)
    pmap, starts = padded_map(counts)
    pos = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts, strict=False)]).cuda()
    act_zero = torch.zeros(starts[-1], inter, dtype=act.dtype, device="cuda")
    act_zero[pos] = act[:n]
    act_rand = torch.randn(starts[-1], inter, device="cuda").to(act.dtype).mul_(act.float().std().item())
    act_rand[pos] = act[:n]
    order_p = torch.zeros(starts[-1], dtype=torch.int32, device="cuda")
    order_p[pos] = order[:n].to(order_p.dtype)
    lib_map, _ = fe.tile_map(offsets, down.block_m, pairs)
    ys = {k: torch.zeros(pairs, 7168, dtype=act.dtype, device="cuda") for k in ("lib", "zero", "rand")}
    fns = {"lib": lambda: fe.launch_down(act, order, offsets, case.w2, ys["lib"], down, pairs, True, None,
                                         (lib_map, None)),
           "zero": lambda: fe.launch_down(act_zero, order_p, offsets, case.w2, ys["zero"], down, pairs, True,
                                          None, (pmap, None)),
           "rand": lambda: fe.launch_down(act_rand, order_p, offsets, case.w2, ys["rand"], down, pairs, True,
                                          None, (pmap, None))}
    burst = alternating_ms(fns, 10, rotate=True)
    rows = order[:n].long()
    same = {k: bool(torch.equal(ys[k][rows], ys["lib"][rows])) for k in ("zero", "rand")}
    held = {k: [] for k in fns}
    for r in range(reps):
        names = list(fns)[r % 3:] + list(fns)[:r % 3]
        for k in names:
            held[k].append(sustained_ms(fns[k], 1.0))
    held = {k: min(v) for k, v in held.items()}
    return {**row, "tiles_lib": int(lib_map[0]), "tiles_padded": int(pmap[0]), "burst_ms": burst,
            "held_ms": held, "same_bits": same, "pad_rows": starts[-1] - n}


def _line(r: dict) -> str:
    b, h = r["burst_ms"], r["held_ms"]
    return (f"I={r['I']} L={r['L']} T={r['T']} tiles {r['tiles_lib']}/{r['tiles_padded']} pad rows "
            f"{r['pad_rows']} of {r['pairs']} | burst lib {b['lib']:.3f} ms, "
            f"zero {b['zero'] / b['lib']:.3f}, "
            f"rand {b['rand'] / b['lib']:.3f} | held lib {h['lib']:.3f} ms, zero {h['zero'] / h['lib']:.3f}, "
            f"rand {h['rand'] / h['lib']:.3f} | same bits {r['same_bits']}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=3, limits=True))
