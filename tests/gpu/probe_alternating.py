"""Why a small experts call reads slower in ``dbo.bench experts`` (which alternates the library's
call with the unfused steps') than its GPU time: per call, the event time, the host time
(``perf_counter`` around the call, no sync), and the GPU's idle gap before the call (from the
previous call's end event to this call's start event: > 0 means the queue had drained).

    python3 tests/gpu/probe_alternating.py [--shapes I:L:T ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dbo.bench.experts import experts_call, make_case
from dbo.moe import SwiGLUExperts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["256:32:1024", "256:32:4096", "768:32:2048"])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    for spec in a.shapes:
        inter, local, tokens = (int(v) for v in spec.split(":"))
        case = make_case(tokens, 7168, inter, local)
        calls = {"library": experts_call(case), "unfused": experts_call(case, SwiGLUExperts(fused=False))}
        for _ in range(5):
            for fn in calls.values():
                fn()
        torch.cuda.synchronize()
        rec = {n: {"event": [], "host": [], "gap": []} for n in calls}
        prev_end = None
        marks = []
        for _ in range(a.steps):
            for name, fn in calls.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                t0 = time.perf_counter()
                fn()
                host = (time.perf_counter() - t0) * 1e3
                e.record()
                marks.append((name, prev_end, s, e, host))
                prev_end = e
        torch.cuda.synchronize()
        for name, pe, s, e, host in marks:
            rec[name]["event"].append(s.elapsed_time(e))
            rec[name]["host"].append(host)
            if pe is not None:
                rec[name]["gap"].append(pe.elapsed_time(s))
        for name, r in rec.items():
            print(f"I={inter} L={local} T={tokens} {name:>8}: event {statistics.median(r['event']):.3f} ms, "
                  f"host {statistics.median(r['host']):.3f} ms, idle gap before "
                  f"{statistics.median(r['gap']):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
