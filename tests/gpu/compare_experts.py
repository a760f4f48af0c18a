"""Time the library's experts (dbo.moe.SwiGLUExperts) against the overlap benchmark's former
experts (tests/gpu/baseline_experts.py) at the benchmark's shapes, on one GPU.

    python tests/gpu/compare_experts.py [--quick] [--json PATH]

Prints one row per shape (hidden, expert intermediate I, local experts L of 256, tokens this rank
received, top-8): the median time of ``apply`` for the old experts, the library's with the host
counts DeepEP normal mode hands over (the case the old experts were built for) and the library's
with device-side offsets only (what naive/all2all hand over; the old experts would read the
counts back there, a host sync), the speedups over the old experts, and a verdict. Exits 1 if the
library with host counts is slower than the old experts beyond noise (ratio < 0.95) on a shape,
or if an output differs from the old one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_experts import OldChunkedSwiGLUExperts  # noqa: E402 - tests/gpu is not a package

from dbo.bench.experts import run_grid  # noqa: E402
from dbo.moe import SwiGLUExperts  # noqa: E402

OLD, HOST, DEV = "old bench experts", "library host counts", "library device offs"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="hidden 7168 only, I 256 and 2048")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = {OLD: (OldChunkedSwiGLUExperts(), True), HOST: (SwiGLUExperts(), True),
             DEV: (SwiGLUExperts(), False)}
    grid = dict(hidden=[7168, 2048], intermediate=[256, 512, 2048], tokens=[4096, 8192, 16384],
                local_experts=[128, 64])
    if a.quick:
        grid.update(hidden=[7168], intermediate=[256, 2048])
    with torch.inference_mode():
        rows = run_grid(impls, topk=8, steps=a.steps, log=lambda s: print(s, file=sys.stderr, flush=True),
                        **grid)
    print(f"\n=== experts timing: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"top-8 of 256 experts, median of {a.steps} apply() calls each (CUDA events, implementations "
          "interleaved)")
    print("speedup = old ms / library ms (> 1: the library is faster); pairs = local (token, expert) "
          "pairs; err = relative difference of the output from the old experts' output")
    print(f"{'hidden':>6} {'I':>5} {'L':>4} {'tokens':>6} {'pairs':>7} | {'old ms':>8} "
          f"{'lib(host) ms':>12} {'lib(dev) ms':>11} | {'speedup host':>12} {'speedup dev':>11} | "
          f"{'err host':>8} {'err dev':>8} | verdict")
    bad, logs = [], []
    for r in rows:
        res = r["results"]
        old, host, dev = (res[k]["median_ms"] for k in (OLD, HOST, DEV))
        s_host, s_dev = old / host, old / dev
        errs = res[HOST]["rel_err"], res[DEV]["rel_err"]
        logs.append(math.log(s_host))
        verdict = "ok" if s_host >= 0.98 else ("within noise" if s_host >= 0.95 else "SLOWER")
        if max(errs) > 2e-2:
            verdict = "OUTPUT DIFFERS"
        if verdict in ("SLOWER", "OUTPUT DIFFERS"):
            bad.append(r)
        print(f"{r['hidden']:>6} {r['intermediate']:>5} {r['local_experts']:>4} {r['tokens']:>6} "
              f"{r['local_pairs']:>7} | {old:>8.3f} {host:>12.3f} {dev:>11.3f} | {s_host:>12.3f} "
              f"{s_dev:>11.3f} | {errs[0]:>8.1e} {errs[1]:>8.1e} | {verdict}")
    gmean = math.exp(sum(logs) / len(logs))
    print(f"geometric-mean speedup of the library (host counts) over the old experts: {gmean:.3f} "
          f"over {len(rows)} shapes; {len(rows) - len(bad)} shapes ok or within noise, {len(bad)} not")
    print("RESULT:", "PASS (library experts at least as fast as the old benchmark experts)" if not bad
          else "FAIL (see the rows marked SLOWER / OUTPUT DIFFERS)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
