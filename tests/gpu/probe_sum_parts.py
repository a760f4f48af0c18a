"""The flat down GEMM and the top-k sum by column parts, each part's sum on another stream while
the next part's products run (``fused_swiglu_experts(sum_parts=...)``), against one down launch
and then the sum, on the GPU host: the library's whole call, same run, same inputs, calls
alternating behind a GPU sleep, each output checked bit for bit against the one-part call's.

The top-k sum reads every local row of ``y`` back (``[pairs, hidden]``) and is memory-bound; the
flat down kernel at I <= 768 is bound by neither its products nor memory (Nsight: SM 55%, DRAM
38% at I=256). Two schemes: the parts' sums on a second stream ("side"), or the down parts on a
high-priority second stream and the sums on the caller's ("down"), so that the down kernel's
programs are placed first and the sum's fill what is left of each SM.

    python3 tests/gpu/probe_sum_parts.py [--json out.json] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms  # noqa: E402

from dbo.bench.experts import experts_call, make_case  # noqa: E402
from dbo.bench.limits import experts_cost, measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(256, 32, 4096), (256, 32, 16384), (256, 32, 65536), (256, 128, 16384), (256, 256, 4096),
          (256, 256, 16384), (256, 256, 65536), (768, 32, 16384), (768, 256, 16384), (2048, 128, 4096),
          (2048, 256, 8192)]
VARIANTS = [(1, "side"), (2, "side"), (3, "side"), (4, "side"), (2, "down"), (3, "down"), (4, "down")]


def with_parts(call, parts: int, side: str):
    def run():
        fe.SUM_PARTS, fe.PARTS_SIDE = parts, side
        try:
            return call()
        finally:
            fe.SUM_PARTS, fe.PARTS_SIDE = 1, "side"
    return run


def one_shape(lim, inter: int, local: int, t: int, reps: int, variants) -> dict:
    case = make_case(t, 7168, inter, local, seed=t)
    call = experts_call(case)
    fns = {f"{p}{s}": with_parts(call, p, s) for p, s in variants}
    want = fns["1side"]().clone()
    same = {k: bool(torch.equal(f(), want)) for k, f in fns.items()}
    ms = alternating_ms(fns, reps, rotate=True)
    pairs = int(case.counts.sum())
    flops, nbytes = experts_cost(hidden=7168, intermediate=inter, local_pairs=pairs,
                                 experts_with_rows=int((case.counts > 0).sum()))
    limit_ms = lim.time_ms(flops, nbytes)
    base = ms["1side"]
    row = {"shape": [inter, local, t], "limit_ms": limit_ms, "ms": ms, "same_bits": same,
           "x_limit": base / limit_ms, "over_one": {k: v / base for k, v in ms.items()}}
    print(f"I={inter:5d} L={local:3d} T={t:6d} one part {base:8.3f} ms ({base / limit_ms:.2f}x limit) | "
          + " ".join(f"{k} {v / base:.3f}" for k, v in ms.items() if k != "1side")
          + ("" if all(same.values()) else f"  NOT SAME BITS {same}"), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--variants", nargs="*", help="PARTS:SIDE, e.g. 2:side 3:down (1:side always runs)")
    a = p.parse_args()
    variants = VARIANTS if not a.variants else [(1, "side")] + [
        (int(v.split(":")[0]), v.split(":")[1]) for v in a.variants]
    lim = measure_device_limits()
    print(f"{torch.cuda.get_device_name()}: copy {lim.copy_gbps / 1e3:.2f} TB/s, "
          f"GEMM {lim.gemm_tflops:.0f} TFLOP/s; time over the one-part call's", flush=True)
    rows = [one_shape(lim, i, n, t, a.reps, variants) for i, n, t in SHAPES]
    ok = all(all(r["same_bits"].values()) for r in rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "same_bits": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
