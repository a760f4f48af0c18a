"""CPU cost of one ubatch switch: dbo's greenlet context against a thread ping-pong.

    python -m dbo.bench switch                 # CPU stand-in streams
    python -m dbo.bench switch --device cuda   # real CUDA streams attached

dbo: two ubatches each call ``dbo_yield`` N times inside one ``run_ubatches`` (tracing off);
cost = time / 2N. Threads: two threads hand control back and forth with ``threading.Event``
(the scheme vLLM's ubatching uses), N round trips; cost = time / 2N. Both are measured in the
same process, alternating, R times; the table gives the minimum and the median of the R runs
and the ratio of medians. The verdict checks the targets: a dbo switch <= 1.5 us (median) and
>= 5x cheaper than the thread hand-off.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch

from dbo import dbo_yield, run_ubatches
from dbo.bench.cli import ArgumentParser, check_device, check_writable_file, legend, verdict
from dbo.cli import run_main
from dbo.files import write_whole

__all__ = ["bench_dbo", "bench_threads", "bench_greenlet_floor", "main", "TARGET_US", "TARGET_RATIO"]

PROG = "python -m dbo.bench switch"
TARGET_US = 1.5     #: the most a dbo switch may cost (median, microseconds of CPU)
TARGET_RATIO = 5.0  #: how many times cheaper than a thread hand-off it must be


def bench_dbo(n: int, device: str) -> float:
    def body() -> None:
        for _ in range(n):
            dbo_yield()

    t0 = time.perf_counter()
    run_ubatches([body, body], device=device)
    return (time.perf_counter() - t0) / (2 * n)


def bench_greenlet_floor(n: int) -> float:
    """Two bare greenlets switching to each other: the floor under any greenlet scheme."""
    import greenlet

    peers: list = []

    def body(me: int) -> None:
        other = peers[1 - me].switch
        for _ in range(n):
            other()

    peers.extend([greenlet.greenlet(lambda: body(0)), greenlet.greenlet(lambda: body(1))])
    t0 = time.perf_counter()
    peers[0].switch()
    dt = time.perf_counter() - t0
    peers[1].switch()  # let the second one finish too
    return dt / (2 * n)


def bench_threads(n: int, device: str) -> float:
    go = [threading.Event(), threading.Event()]
    cuda = device == "cuda"

    def worker(me: int) -> None:
        # vLLM's scheme: each ubatch thread also sets its current stream when it resumes.
        stream = torch.cuda.current_stream() if cuda else None
        for _ in range(n):
            go[me].wait()
            go[me].clear()
            if cuda:
                torch.cuda.set_stream(stream)
            go[1 - me].set()

    t = threading.Thread(target=worker, args=(1,), daemon=True)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        go[1].set()
        go[0].wait()
        go[0].clear()
    dt = time.perf_counter() - t0
    t.join()
    return dt / (2 * n)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--switches", type=int, default=100_000, help="yields per ubatch per run")
    ap.add_argument("--thread-switches", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    for name in ("switches", "thread_switches", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    check_device(ap, args.device)
    if args.json:
        check_writable_file(ap, "--json", args.json)
    bench_dbo(1000, args.device)  # warm-up: streams, events, code paths
    bench_threads(1000, args.device)
    dbo_us, thr_us, floor_us = [], [], []
    for _ in range(args.repeats):
        dbo_us.append(bench_dbo(args.switches, args.device) * 1e6)
        thr_us.append(bench_threads(args.thread_switches, args.device) * 1e6)
        floor_us.append(bench_greenlet_floor(args.switches) * 1e6)
    res = {
        "device": args.device,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dbo_us_min": min(dbo_us),
        "dbo_us_median": statistics.median(dbo_us),
        "threads_us_min": min(thr_us),
        "threads_us_median": statistics.median(thr_us),
        "greenlet_floor_us_min": min(floor_us),
        "greenlet_floor_us_median": statistics.median(floor_us),
    }
    res["ratio_median"] = res["threads_us_median"] / res["dbo_us_median"]
    print(f"device={args.device} python={res['python']} torch={res['torch']} repeats={args.repeats}")
    print(f"{'scheme':<28}{'min us/switch':>15}{'median us/switch':>18}")
    print(f"{'dbo greenlet (dbo_yield)':<28}{res['dbo_us_min']:>15.3f}{res['dbo_us_median']:>18.3f}")
    print(f"{'threads + threading.Event':<28}{res['threads_us_min']:>15.3f}"
          f"{res['threads_us_median']:>18.3f}")
    print(f"{'bare greenlet switch (floor)':<28}{res['greenlet_floor_us_min']:>15.3f}"
          f"{res['greenlet_floor_us_median']:>18.3f}")
    print("\n".join(legend({"min, median": f"over {args.repeats} repeats, microseconds per switch",
                             "dbo greenlet": "two ubatches of run_ubatches handing over with dbo_yield",
                             "threads": "two threads handing over with threading.Event",
                             "floor": "a bare greenlet switch, the least a switch costs"})))
    print(f"dbo is {res['ratio_median']:.1f}x cheaper per switch (medians)")
    if args.json:
        write_whole(args.json, json.dumps(res, indent=2))
    ok = res["dbo_us_median"] <= TARGET_US and res["ratio_median"] >= TARGET_RATIO
    return verdict(PROG, ok, f"a dbo switch costs {res['dbo_us_median']:.2f} us, "
                             f"{res['ratio_median']:.1f}x cheaper than a thread hand-off (targets: "
                             f"<= {TARGET_US} us, >= {TARGET_RATIO:g}x)")


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
