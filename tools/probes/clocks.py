"""The SM clock and the board power while a kernel runs for seconds: a large bf16 GEMM (the
benchmark's ceiling, ``dbo.bench.limits``), then the library's experts call at a few shapes, each
back to back for ``--seconds``. ``nvidia-smi`` samples the GPU every 50 ms in the background.

    python3 tools/probes/clocks.py [--shapes I:L:T ...] [--seconds 4]

Per phase it prints the achieved rate (TFLOP/s, each call's flops over its mean time) and the
median SM clock, power and throttle reasons of the samples taken in that phase: whether the
GEMM-bound calls run at the clock the ceiling was measured at.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dbo.bench.experts.command import experts_call, make_case  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smi_rows import read_smi  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def _loop(fn, seconds: float) -> tuple[float, float, float, int]:
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(4):
            fn()
        n += 4
        torch.cuda.synchronize()
    t1 = time.time()
    return t0, t1, (t1 - t0) / n, n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["2048:256:32768", "256:256:65536", "2048:32:8192"])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--zero-rows", nargs="*", type=float, default=[],
                    help="the GEMM again with this share of its first operand's rows zero (what a "
                         "tile's rows past an expert's end multiply, where they are zeros): whether "
                         "zero operands cost the power cap less")
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=log, stderr=subprocess.DEVNULL)
        phases = _phases(a)
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    samples = []
    for ts, f in read_smi(log.name, utc=False):
        try:
            samples.append((ts, float(f[0]), float(f[1]), f[2]))
        except (ValueError, IndexError):
            continue
    for name, t0, t1, tflops, reps in phases:
        s = [x for x in samples if t0 + 0.5 <= x[0] <= t1]  # (the first half second: clocks settle)
        if not s:
            print(f"{name}: {tflops:.0f} TFLOP/s over {reps} calls; no samples", flush=True)
            continue
        clock = [x[1] for x in s]
        watts = statistics.median(x[2] for x in s)
        print(f"{name}: {tflops:.0f} TFLOP/s over {reps} calls | SM clock median "
              f"{statistics.median(clock):.0f} MHz ({min(clock):.0f}-{max(clock):.0f}), power median "
              f"{watts:.0f} W, throttle reasons {sorted({x[3] for x in s})} ({len(s)} samples)", flush=True)
    return 0


def _phases(a) -> list[tuple[str, float, float, float, int]]:
    # (name, start, end, TFLOP/s, calls) of each phase
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t0, t1, dt, reps = _loop(lambda: x @ w, a.seconds)
    phases = [("gemm 8192", t0, t1, 2 * n**3 / dt / 1e12, reps)]
    for share in a.zero_rows:
        # the last rows of every 128-row tile zero, as past an expert's end
        pad = torch.arange(n, device=x.device) % 128 >= round(128 * (1 - share))
        xz = x.masked_fill(pad[:, None], 0)
        t0, t1, dt, reps = _loop(lambda xz=xz: xz @ w, a.seconds)
        phases.append((f"gemm 8192, {share:.0%} rows zero", t0, t1, 2 * n**3 / dt / 1e12, reps))
    for shape in a.shapes:
        inter, local, tokens = (int(v) for v in shape.split(":"))
        case = make_case(tokens, 7168, inter, local)
        flops = 6.0 * int(case.counts.sum()) * 7168 * inter
        t0, t1, dt, reps = _loop(experts_call(case), a.seconds)
        phases.append((f"experts {shape}", t0, t1, flops / dt / 1e12, reps))
        del case
        torch.cuda.empty_cache()
    return phases


if __name__ == "__main__":
    sys.exit(main())
