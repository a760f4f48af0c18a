"""Where the host time of an overlap benchmark run goes: ``dbo.bench overlap`` under cProfile.

    torchrun --nproc-per-node 4 tools/probes/profile_bench.py [--top 40] [--out DIR] -- \
        --device cuda --backend copy_engine --layers 8 --intermediate 256 --attn-width 1024 \
        --tokens 4096 --modes dbo --steps 30 --no-autotune --profile-shape none

Every rank runs the benchmark (its arguments after ``--``) under cProfile; rank 0 prints the
functions with the most own time and the most cumulative time, and each rank writes its stats to
``DIR/rank<R>.prof`` (``python -m pstats`` reads them). Where a DBO step is host-bound (the
benchmark warns: CPU launch time >= 80% of the GPU time), this says which Python sets the pace.
Set-up (model, reference, compilation) is in the profile too: run many ``--steps`` of one mode.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default="profile_bench")
    a = p.parse_args(own)
    from dbo.bench.overlap.command import main as bench_main

    rank = int(os.environ.get("RANK", "0"))
    prof = cProfile.Profile()
    prof.enable()
    try:
        rc = bench_main(bench_args)
    finally:
        prof.disable()
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(out / f"rank{rank}.prof"))
    if rank == 0:
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
            print(f"=== rank 0, by {key}\n{s.getvalue()}", flush=True)
    return rc or 0


if __name__ == "__main__":
    raise SystemExit(main())
