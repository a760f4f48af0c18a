"""Where the host time of one experts ``apply`` goes, on the GPU host.

    python3 tools/probes/profile_host.py [--shapes I:L:T ...] [--calls 300] [--top 30]

For each shape (intermediate size, local experts, tokens; hidden 7168, top-8 of 256): the host
time of one ``SwiGLUExperts.apply`` with the GPU kept busy (no launch waits), then a cProfile of
``--calls`` applies (the functions with the most own time). The experts benchmark's small rows
are launch-bound (docs/performance.md): this says which Python costs them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

from dbo.bench.experts.command import experts_call, make_case

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_cost import per_call_us  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["256:32:1024", "256:32:8192", "2048:256:1024"])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    for spec in a.shapes:
        inter, local, tokens = (int(v) for v in spec.split(":"))
        fn = experts_call(make_case(tokens, 7168, inter, local))
        print(f"=== I={inter} L={local} T={tokens}: apply host {per_call_us(fn, 50):.1f} us per call "
              f"(GPU kept busy)", flush=True)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(s.getvalue(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
