"""The Gluon short-K down GEMM (tests/gpu/gluon_down_experiment.py) against the library's Triton down tile, on
the GPU host: the same output (the rows each writes), and the time of each (CUDA events, median)
against the GEMM's own limit, per shape at I=256.

    python3 tests/gpu/probe_gluon_down.py [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gluon_down_experiment as gd  # noqa: E402
from tune_experts import down_probe_inputs, median_ms, probe_shapes  # noqa: E402

from dbo.bench.limits import DeviceLimits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(256, 32, 4096), (256, 32, 8192), (256, 32, 16384), (256, 32, 65536), (256, 128, 4096),
          (256, 128, 16384), (256, 256, 2048), (256, 256, 8192), (256, 256, 16384), (256, 256, 65536)]
#: (warps, column blocks per item (None: the library's choice), two accumulators, stages)
VARIANTS = [(4, None, False, 3), (4, None, True, 3), (8, None, True, 3), (8, None, True, 4), (4, 16, True, 3),
            (4, 112, True, 3), (8, 16, True, 3), (8, 112, True, 3), (8, 16, True, 4), (8, 112, True, 4)]


def one_shape(lim: DeviceLimits, inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case, order, offsets, down, act, persist, r = down_probe_inputs(lim, inter, local, t, hidden, topk)
    est = t * topk / 256  # as the library estimates without host counts
    y_ref = torch.zeros(t * topk, hidden, dtype=case.x.dtype, device="cuda")

    def triton_down() -> None:
        fe.launch_down(act, order, offsets, case.w2, y_ref, down, t * topk, persist)

    r["triton_ms"] = median_ms(triton_down, reps)
    for warps, npp, two, stages in VARIANTS:
        y = torch.zeros_like(y_ref)

        def gluon_down(w: int = warps, n: int | None = npp, yy: torch.Tensor = y, tw: bool = two,
                       st: int = stages) -> None:
            gd.launch_down_short_k(act, order, offsets, case.w2, yy, t * topk, est, num_warps=w, npp=n,
                                   two_acc=tw, stages=st)

        try:
            gluon_down()
        except Exception as e:  # noqa: BLE001 - reported per variant
            print(f"  {warps} {npp} {two} {stages}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        torch.cuda.synchronize()
        name = f"gluon_w{warps}_npp{npp}_{'two' if two else 'one'}_s{stages}"
        r[f"{name}_maxdiff"] = float((y.float() - y_ref.float()).abs().max())
        r[f"{name}_ms"] = median_ms(gluon_down, reps)
    return r


def _line(r: dict) -> str:
    own, tri = r["limit_ms"], r["triton_ms"]
    best = min((k for k in r if k.startswith("gluon") and k.endswith("_ms")), key=r.get, default=None)
    res = f"best {best} {r[best]:.3f} ({r[best] / own:.2f}x, {r[best] / tri:.3f} of triton)" if best \
        else "no gluon result"
    variants = " ".join(f"{k}={v:.4g}" for k, v in r.items() if k.startswith("gluon"))
    return (f"I={r['I']} L={r['L']} T={r['T']} pairs={r['pairs']} own limit {own:.3f} ms | triton {tri:.3f} "
            f"({tri / own:.2f}x) | {res}\n   {variants}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20, limits=True))
