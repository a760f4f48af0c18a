"""The top-k sum's program size on the GPU host: ``launch_topk_sum`` with a program per token and
``block`` columns (the library: ``TOPK_SUM_BLOCK`` = 2048 columns, four warps, four programs per
token at hidden 7168; 1024 before) against other sizes, each timed alone (median of back-to-back
launches), same run, same inputs, and each output checked bit for bit against the library's.

A program's local slots are a chain of dependent steps (the ids, then each slot's row behind a
branch), so with many small programs the kernel waits on latency rather than on bandwidth; fewer,
wider programs issue a slot's whole row at once.

    python3 tests/gpu/probe_topk_sum.py [--json out.json]
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

from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(32, 4096), (32, 16384), (32, 65536), (128, 16384), (256, 4096), (256, 16384), (256, 65536)]
#: (block, warps); the first is the library's (TOPK_SUM_BLOCK; 1024 before)
VARIANTS = [(2048, 4), (1024, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]


def one_shape(lim, local: int, t: int, hidden: int, reps: int) -> dict:
    topk = 8
    g = torch.Generator(device="cuda").manual_seed(t + local)
    tw, ids = torch.topk(torch.softmax(torch.randn(t, 256, device="cuda", generator=g), -1), topk)
    ids = torch.where(ids < local, ids, -1).to(torch.int32)
    y = torch.randn(t * topk, hidden, device="cuda", generator=g).bfloat16()
    n_local = (ids >= 0).sum(1)
    rows = {}
    for sole in (False, True) if local < 128 else (False,):
        busy = n_local != 1 if sole else torch.ones_like(n_local, dtype=torch.bool)
        # bytes: the local rows of the tokens it sums, read; the tokens it writes
        nbytes = (int(n_local[busy].sum()) + int(busy.sum())) * hidden * 2
        ref, ms = None, {}
        for block, warps in VARIANTS:
            out = torch.full((t, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run(b=block, w=warps, o=out, s=sole):
                fe.launch_topk_sum(y, ids, tw, o, local, s, block=b, num_warps=w)
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = out
            else:
                same = torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))
                assert same, (block, warps)
            ms[f"{block}/{warps}"] = sorted(median_ms(run, 20) for _ in range(reps))[reps // 2]
        base = ms[f"{VARIANTS[0][0]}/{VARIANTS[0][1]}"]
        print(f"L={local:>3} T={t:>5} sole={sole:d} | library {base * 1e3:.1f} us "
              f"({nbytes / base / 1e9:.2f} TB/s, limit {lim.copy_gbps / 1e3:.2f}) | " + " ".join(
                  f"{k} {v / base:.3f}" for k, v in ms.items()), flush=True)
        rows[f"sole={sole}"] = {"ms": ms, "bytes": nbytes}
    return {"L": local, "T": t, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    with torch.inference_mode():
        rows = [one_shape(lim, loc, t, 7168, a.reps) for loc, t in SHAPES]
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
