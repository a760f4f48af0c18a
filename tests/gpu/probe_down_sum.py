"""Where the flat down kernel's own top-k sum (``sum_in_down``) spends its time, on the GPU host:
the tile map and the down kernel (and the top-k sum where one runs after it), timed alone for
each way to the output, same run, same inputs.

* ``plain``: every row to ``y``, then the top-k sum; ``sole``: the sole rows straight to the output;
* ``sum``: the down kernel sums each token's rows (no top-k sum), and its cut-down copies, which
  give wrong outputs and only time a part: ``sum-nobar`` (no block barrier before the counters),
  ``sum-relaxed`` (relaxed counter atomics), ``sum-nosum`` (the counters, no sum), ``sum-noatomic``
  (neither: only the sole rows and the stores to ``y``).

    python3 tests/gpu/probe_down_sum.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import median_ms  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe.fused_tiles import pick_configs  # noqa: E402

SHAPES = [(256, 32, 16384), (256, 256, 16384), (768, 256, 16384), (2048, 256, 8192)]
VARIANTS = {"plain": None, "sole": None, "sum": 0, "sum-nobar": 1, "sum-relaxed": 2, "sum-nosum": 3,
            "sum-noatomic": 4}


def one_shape(inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case = make_case(t, hidden, inter, local, seed=t)
    pairs = t * topk
    est = pairs * local / 256 / local
    up, down = pick_configs(est, inter, local)
    ids, tw = case.ids, case.weights
    order, offsets = fe.route_order(ids, local)
    act = torch.empty(pairs, inter, dtype=case.x.dtype, device="cuda")
    fe.launch_gate_up(case.x, order, offsets, case.w1, act, up, pairs, topk, True)
    y = torch.empty(pairs, hidden, dtype=case.x.dtype, device="cuda")
    out = torch.empty_like(case.x)
    n_col = fe.cdiv(hidden, down.block_n)
    a_desc = fe.Desc(act, (down.block_m, down.block_k))
    w = fe.Desc(case.w2.view(local * hidden, inter), (down.block_n, down.block_k))
    res = {}

    def run(name):
        if name in ("plain", "sole"):
            done = fe.launch_down(act, order, offsets, case.w2, y, down, pairs, True,
                                  (ids, tw, out) if name == "sole" else None)
            fe.launch_topk_sum(y, ids, tw, out, local, done == "sole")
            return
        tiles, aux = fe.tile_map(offsets, down.block_m, pairs, sums=(ids, out, n_col))
        fe._launch(fe.down_flat_kernel, fe._bound(down, pairs, local, hidden), act.device, (
            a_desc, order, tiles, w, y, tw, out, ids, aux, local, hidden, inter), dict(
            BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, GROUP_M=down.group_m,
            TOPK=topk, SOLE=False, SUM=True, SUM_ROWS=fe.SUM_ROWS, PROBE=VARIANTS[name],
            num_warps=down.num_warps, num_stages=down.num_stages), True)

    ref = None
    for name in VARIANTS:
        run(name)
        torch.cuda.synchronize()
        if name == "plain":
            ref = out.clone()
        elif name in ("sole", "sum"):
            assert torch.equal(out, ref), name
    for _ in range(reps):
        for name in VARIANTS:
            res.setdefault(name, []).append(median_ms(lambda n=name: run(n), 10))
    ms = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    print(f"I={inter} L={local} T={t} down {down} | plain {ms['plain'] * 1e3:.0f} us | " + " ".join(
        f"{k} {ms[k] / ms['plain']:.3f}" for k in ms if k != "plain"), flush=True)
    return {"I": inter, "L": local, "T": t, "ms": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    with torch.inference_mode():
        rows = [one_shape(i, loc, t, a.reps) for i, loc, t in SHAPES]
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
