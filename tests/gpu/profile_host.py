"""Where the host time of one experts ``apply`` goes, on the GPU host.

    python3 tests/gpu/profile_host.py [--shapes I:L:T ...] [--calls 300] [--top 30]

For each shape (intermediate size, local experts, tokens; hidden 7168, top-8 of 256): the host
time of one ``SwiGLUExperts.apply`` with the GPU kept busy (no launch waits), then a cProfile of
``--calls`` applies (the functions with the most own time). The experts benchmark's small rows
are launch-bound (docs/perf_notes.md section 5): this says which Python costs them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from dbo.bench.experts import _apply, make_case
from dbo.moe import SwiGLUExperts, Workspace


def _busy(n: int = 20) -> None:
    a = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        a @ a


def host_us(fn, reps: int = 7, n: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        _busy()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["256:32:1024", "256:32:8192", "2048:256:1024"])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    for spec in a.shapes:
        inter, local, tokens = (int(v) for v in spec.split(":"))
        case = make_case(tokens, 7168, inter, local)
        experts = SwiGLUExperts()
        experts.note_global_num_experts(256)
        ws = Workspace()

        def fn(e=experts, c=case, w=ws):
            return _apply(e, c, False, w)

        print(f"=== I={inter} L={local} T={tokens}: apply host {host_us(fn):.1f} us per call "
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
