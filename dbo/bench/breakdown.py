"""Where the time of a DBO step goes, from the benchmark's torch.profiler traces.

``python -m dbo.bench breakdown SERIAL.json DBO.json`` (``gpu_trace_serial.json`` and
``gpu_trace_dbo.json`` of a ``dbo.bench overlap`` bundle; ``.json.gz`` works too) prints, for each
step, the GPU time of each kernel category, the busy and idle time of the compute (the union of the
kernels that neither move nor wait for data, DeepEP's, the simulated link's and the emulated rank's
own, on any stream: a CUDA graph's replay spreads its kernels over streams of its own) and the
step's span, then the
overlap arithmetic: idle time removed, compute time added, and the share of the serial step's idle
(its communication) that was hidden, and where the host's time of the step went (:func:`host_split`:
kernel launches, waits on the GPU, other CUDA calls, and the rest: Python and torch's dispatch).
The verdict: PASS when the DBO step hid some of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

from dbo.bench.cli import ArgumentParser, legend, verdict
from dbo.bench.timeline import read_chrome_trace
from dbo.cli import run_main

__all__ = ["CATEGORIES", "MOVING", "HOST_PARTS", "breakdown", "host_split", "main"]

PROG = "python -m dbo.bench breakdown"

#: the simulated link's modelled waits, on a link stream of their own:
#: the global-timer wait (``dbo.backends.simulated_link.wall_wait``), or torch's cycle-counting
#: spin kernel without Triton
LINK_WAITS = ("_wait_wall_kernel", "_nic_flow_kernel", "spin_kernel")

CATEGORIES = (  # (name, substring of the kernel name), first match wins
    ("DeepEP", "deep_ep"),
    *(("link wait (simulated)", w) for w in LINK_WAITS),
    ("grouped GEMM", "cutlass"),
    ("fused experts", "gate_up_kernel"),  # dbo.experts.kernels' Triton and Gluon kernels
    ("fused experts", "gate_up_ws_kernel"),
    ("fused experts", "down_kernel"),
    ("fused experts", "down_flat_kernel"),
    ("fused experts", "down_short_k_kernel"),
    ("top-k sum", "topk_sum_kernel"),
    ("attention", "flash"),
    ("attention", "fmha"),
    ("dense GEMM", "nvjet"),
    ("dense GEMM", "gemm"),
    ("token gather", "gather_kernel"),
    # the emulated rank's own work of a call (dbo.backends.emulated.kernels)
    *(("emulated comm work", k) for k in ("_send", "_unpack", "_units", "_ht_receive", "_ht_combine")),
    ("gather-reduce", "gather_reduce"),
    ("index_add", "indexFunc"),
)


#: the host's CUDA calls by what they cost it, (part, substring of the call's name), first match
#: wins; the host's time outside them is Python and torch's own dispatch
HOST_PARTS = (
    ("launches", "Launch"),  # cudaLaunchKernel(ExC), cuLaunchKernel(Ex), cudaGraphLaunch
    ("waits on the GPU", "Synchronize"),  # cudaEventSynchronize, cudaStreamSynchronize, ...
    ("waits on the GPU", "cudaMemcpy "),  # a blocking copy (the async ones are "cudaMemcpyAsync")
    ("other CUDA calls", ""),
)


def host_split(path: str) -> dict[str, float]:
    """Where the host's time of one trace's step went, ms: ``span`` (the main thread's first to
    last event), each :data:`HOST_PARTS` part (the CUDA runtime and driver calls' time), and
    ``Python and dispatch`` (the rest). Reads the busiest host thread (the one that ran the
    step). Empty where the trace holds no CUDA calls."""
    events = [e for e in read_chrome_trace(path)["traceEvents"] if e.get("ph") == "X"]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not calls:
        return {}
    per_thread: dict[tuple, float] = defaultdict(float)
    for e in calls:
        per_thread[(e.get("pid"), e.get("tid"))] += e["dur"]
    main = max(per_thread, key=per_thread.get)
    mine = [e for e in events if (e.get("pid"), e.get("tid")) == main]
    span = (max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)) / 1000
    parts: dict[str, float] = {name: 0.0 for name, _ in HOST_PARTS}
    for e in calls:
        if (e.get("pid"), e.get("tid")) != main:
            continue
        name = next(part for part, key in HOST_PARTS if key in e["name"])
        parts[name] += e["dur"] / 1000
    parts["Python and dispatch"] = max(span - sum(parts.values()), 0.0)
    return {"span": span, **parts}


def _load(path: str) -> list[dict]:
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in read_chrome_trace(path)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in gpu]


#: the categories of kernels that move or wait for data (the rest is the compute)
MOVING = ("DeepEP", "link wait (simulated)", "emulated comm work")


def _category(name: str) -> str:
    for cat, key in CATEGORIES:
        if key in name:
            return cat
    return "other"


def breakdown(path: str) -> dict:
    """One trace's step: ``span``, ``compute_busy``, ``compute_idle`` (ms; the compute: the kernels
    outside :data:`MOVING`, on any stream) and ``categories``
    (ms of kernel time per :data:`CATEGORIES` name).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a JSON (or gzipped JSON) profiler trace, or one without GPU kernels.
    """
    kernels = _load(path)
    if not kernels:
        raise ValueError(f"{path}: no GPU kernels in this trace")
    # the compute: the kernels that neither move nor wait for data, on whichever stream (a CUDA
    # graph's replay spreads its branches over streams of its own, and may run the link's waits
    # on the compute's stream)
    def moves(k: dict) -> bool:
        return _category(k["name"]) in MOVING
    cats: dict[str, float] = defaultdict(float)
    for k in kernels:
        cats[_category(k["name"])] += k["dur"] / 1000
    start = min(k["ts"] for k in kernels)
    span = (max(k["ts"] + k["dur"] for k in kernels) - start) / 1000
    comp = sorted((k for k in kernels if not moves(k)), key=lambda k: k["ts"]) or [kernels[0]]
    busy, end = 0.0, comp[0]["ts"]
    for k in comp:  # union of the compute kernels' intervals
        s, e = max(k["ts"], end), k["ts"] + k["dur"]
        if e > s:
            busy += e - s
        end = max(end, e)
    return {"span": span, "compute_busy": busy / 1000, "compute_idle": span - busy / 1000,
            "categories": dict(cats)}


def _trace_file(path: str) -> str:
    if not os.path.isfile(path):
        what = "not a file" if os.path.exists(path) else "no such file"
        raise argparse.ArgumentTypeError(
            f"{what}: {path!r} (want two torch.profiler traces, e.g. a dbo.bench overlap "
            "bundle's gpu_trace_serial.json and gpu_trace_dbo.json)")
    return path


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("serial", type=_trace_file)
    p.add_argument("dbo", type=_trace_file)
    a = p.parse_args(argv)
    try:
        s, d = breakdown(a.serial), breakdown(a.dbo)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    print(f"{'':32} {'serial ms':>10} {'DBO ms':>10} {'DBO/serial':>10}")
    rows = [("step span", s["span"], d["span"]),
            ("compute busy", s["compute_busy"], d["compute_busy"]),
            ("compute idle", s["compute_idle"], d["compute_idle"])]
    for cat in sorted(set(s["categories"]) | set(d["categories"])):
        rows.append((f"  kernels: {cat}", s["categories"].get(cat, 0.0), d["categories"].get(cat, 0.0)))
    for name, x, y in rows:
        ratio = f"{y / x:10.2f}" if x else f"{'-':>10}"
        print(f"{name:32} {x:10.2f} {y:10.2f} {ratio}")
    hs, hd = host_split(a.serial), host_split(a.dbo)
    if hs and hd:
        print("host (the thread that ran the step):")
        for part in ("span", *dict.fromkeys(name for name, _ in HOST_PARTS), "Python and dispatch"):
            x, y = hs[part], hd[part]
            ratio = f"{y / x:10.2f}" if x else f"{'-':>10}"
            print(f"{'  ' + part:32} {x:10.2f} {y:10.2f} {ratio}")
    print("\n".join(legend({"serial ms, DBO ms": "per step, from each trace",
                             "step span": "first kernel's start to last kernel's end",
                             "busy, idle": "the step's time with and without a compute kernel running "
                             "(any stream; the compute: every kernel but those that move or wait "
                             "for data)",
                             "kernels": "GPU time by kind", "DBO/serial": "DBO ms / serial ms"})))
    removed = s["compute_idle"] - d["compute_idle"]
    added = d["compute_busy"] - s["compute_busy"]
    hidden = removed - added
    if not s["compute_idle"]:
        return verdict(PROG, False, "the serial step's compute is never idle: no "
                                    "communication to hide in these traces")
    print(f"idle removed {removed:.2f} ms, compute added {added:.2f} ms: "
          f"{hidden:.2f} ms of the serial step's {s['compute_idle']:.2f} ms idle hidden "
          f"({hidden / s['compute_idle']:.2f})")
    share = f"{hidden / s['compute_idle']:.2f} of the serial step's idle time"
    if hidden > 0:
        return verdict(PROG, True, f"the DBO step hid {hidden:.2f} ms ({share})")
    return verdict(PROG, False, f"the DBO step hid nothing ({share}): {removed:.2f} ms of idle "
                                f"removed, {added:.2f} ms of compute added")


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
