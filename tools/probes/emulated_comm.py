"""Measures the emulated rank's low-latency dispatch and combine alone (DeepEP's benchmark
settings: 128 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine) at
EP 16/32/64/128/256 under a link, against DeepEP's published internode table.

    python tools/probes/emulated_comm.py [--link deepep-ib] [--steps 30] [--calls 8] [--json OUT]

Each figure is the median over ``--steps`` replays of a CUDA graph holding ``--calls`` calls one
after the other, divided by ``--calls`` (CUDA events around the replay; the send and the receive
in one call, as DeepEP's test times its kernels; no host launch time, and the replay's own launch
spread over the calls), uniform random routing. DeepEP's figures are its kernels' durations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from dbo.backends.emulated import EMULATED, EmulatedGroup
from dbo.backends.emulated.buffer import EmulatedBuffer
from dbo.backends.simulated_link import SimulatedLink
from dbo.backends.simulated_link.presets import DEEPEP_LL_SHAPE, DEEPEP_LL_TABLE, fit_report


def _time(fn, steps: int, calls: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def measure(ep: int, link: SimulatedLink | None, steps: int, calls: int = 8) -> tuple[float, float]:
    shape = DEEPEP_LL_SHAPE
    t, k, hidden, experts = shape["tokens"], shape["topk"], shape["hidden"], shape["num_experts"]
    buf = EmulatedBuffer(EmulatedGroup(ep, 0, shape["gpus_per_host"]), low_latency_mode=True,
                         device="cuda", link=link)
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    scores = torch.randn(t, experts, device="cuda").abs() + 1
    ids = torch.topk(scores, k, dim=-1).indices.to(torch.int64)
    weights = torch.rand(t, k, device="cuda")
    n_local = experts // ep
    y = torch.randn(n_local, ep * t, hidden, device="cuda", dtype=torch.bfloat16)
    handle = None

    def dispatch() -> None:
        nonlocal handle
        _, _, handle, _, _ = buf.low_latency_dispatch(x, ids, t, experts, use_fp8=True)

    def combine() -> None:
        buf.low_latency_combine(y, ids, weights, handle)

    for _ in range(3):
        dispatch()
        combine()
    torch.cuda.synchronize()
    d = _time(dispatch, steps, calls)
    c = _time(combine, steps, calls)
    return d, c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="deepep-ib")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--calls", type=int, default=8, help="calls per captured graph (default 8)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("emulated_comm: needs a CUDA GPU", file=sys.stderr)
        return 2
    link = SimulatedLink.parse(args.link)
    print(fit_report())
    print(f"device: {torch.cuda.get_device_name()}; {link.describe()}")
    print(" EP  dispatch us (DeepEP, x)   combine us (DeepEP, x)   no-link dispatch / combine us")
    rows = {}
    for ep, (dd, dc) in DEEPEP_LL_TABLE.items():
        d0, c0 = measure(ep, None, args.steps, args.calls)
        d, c = measure(ep, link, args.steps, args.calls)
        EMULATED.reset()
        rows[ep] = {"dispatch_us": d, "combine_us": c, "deepep_dispatch_us": dd, "deepep_combine_us": dc,
                    "nolink_dispatch_us": d0, "nolink_combine_us": c0}
        print(f"{ep:>3}  {d:7.1f} ({dd:4.0f}, {d / dd:5.3f})     {c:7.1f} ({dc:4.0f}, {c / dc:5.3f})"
              f"      {d0:6.1f} / {c0:6.1f}")
    worst = max(max(abs(r["dispatch_us"] / r["deepep_dispatch_us"] - 1),
                    abs(r["combine_us"] / r["deepep_combine_us"] - 1)) for r in rows.values())
    print(f"worst deviation from DeepEP's table: {worst:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "link": link.as_dict(), "rows": rows,
                       "worst": worst}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
