"""Where the experts' GPU time goes at one shape: a kernel table per implementation.

    python3 tests/gpu/profile_experts.py [--hidden 2048 --inter 256 --local 64 --tokens 4096]

Profiles 20 ``apply`` calls of the former benchmark experts (host counts) and of the library's
(host counts, device offsets) and prints torch.profiler's CUDA-time table for each, so a shape
where the library is slower shows which kernel costs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_experts import OldChunkedSwiGLUExperts  # noqa: E402

from dbo.bench.experts import _apply, make_case  # noqa: E402
from dbo.moe import SwiGLUExperts, Workspace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    case = make_case(args.tokens, args.hidden, args.inter, args.local)
    impls = {"old (host counts)": (OldChunkedSwiGLUExperts(), True),
             "library (host counts)": (SwiGLUExperts(), True),
             "library (device offsets)": (SwiGLUExperts(), False)}
    for name, (experts, host) in impls.items():
        ws = Workspace()
        for _ in range(5):
            _apply(experts, case, host, ws)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                _apply(experts, case, host, ws)
            torch.cuda.synchronize()
        print(f"=== {name}: H={args.hidden} I={args.inter} L={args.local} T={args.tokens}, 20 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
