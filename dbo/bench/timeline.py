"""Which stream runs what, when: a GPU kernel trace drawn as an SVG timeline.

The input is a torch.profiler Chrome trace (``prof.export_chrome_trace``; the overlap
benchmark writes one per profiled step, ``gpu_trace_<mode>.json``), plain or gzipped
(``.json.gz``, as the bundles under ``docs/results/`` keep them). Each GPU stream is a lane;
each kernel or copy a box, coloured by what it does (:func:`kind_of`): the routed experts'
GEMMs, other matmuls (attention stand-in, shared expert, router), communication (DeepEP's
kernels, NCCL, copies between GPUs, symmetric-memory signals), waits, and the rest. Only a
window of the step is drawn (default: the middle fifth, a layer or two of the steady state),
so that the boxes stay wide enough to see.

    python -m dbo.bench.timeline gpu_trace_dbo.json.gz timeline_dbo.svg [--window 0.4 0.6]

No plotting library is needed: the SVG is written by hand.
"""

from __future__ import annotations

import gzip
import html
import json
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbo.cli import ArgumentParser, check_writable_file, run_main
from dbo.files import write_whole

__all__ = ["KINDS", "kind_of", "read_chrome_trace", "gpu_events", "timeline_svg", "main"]

#: the kinds of GPU work, their colours, in legend order
KINDS = {
    "experts": "#d9534f",
    "matmul": "#f0ad4e",
    "comm": "#337ab7",
    "wait": "#9b59b6",
    "other": "#aaaaaa",
}

_EXPERTS = ("gate_up", "down_kernel", "grouped", "fused_moe", "batched", "_moe", "swiglu")
_COMM = ("deep_ep", "nccl", "all_to_all", "alltoall", "put_signal", "memcpy dtod", "memcpy ptop",
         "copy_engine", "symm")
_WAIT = ("wait_signal", "sleep", "spin", "link_wait")
_MATMUL = ("gemm", "nvjet", "cutlass", "sm90", "splitk", "cublas", "matmul")


def kind_of(name: str, category: str = "kernel") -> str:
    """The kind (a key of :data:`KINDS`) of a GPU event by its name and trace category."""
    n = name.lower()
    for kind, keys in (("wait", _WAIT), ("experts", _EXPERTS), ("comm", _COMM), ("matmul", _MATMUL)):
        if any(k in n for k in keys):
            return kind
    if category == "gpu_memcpy":
        return "comm" if ("peer" in n or "dtod" in n) else "other"
    return "other"


def read_chrome_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace file, plain JSON or gzipped (a name ending in ``.gz``), as
    ``{"traceEvents": [...], ...}`` (a bare list of events is wrapped so).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a (gzipped) JSON trace, or one without a ``traceEvents`` list.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path} is not a JSON profiler trace ({exc})") from None
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a profiler trace (no traceEvents list)")
    return trace


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU kernels and copies of a Chrome trace: ``{"name", "kind", "stream", "ts", "dur"}``
    (microseconds), by start time."""
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") != "X":
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        out.append({"name": str(e.get("name", "")), "kind": kind_of(str(e.get("name", "")), cat),
                    "stream": stream, "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))})
    out.sort(key=lambda e: e["ts"])
    return out


def timeline_svg(trace: dict[str, Any], *, window: Sequence[float] = (0.4, 0.6), title: str = "",
                 width: int = 1200, lane: int = 28) -> str:
    """The SVG timeline of ``trace``'s GPU work between the fractions ``window`` of its span.

    Raises:
        ValueError: a window that is not ``0 <= start < end <= 1``, or a trace with no GPU events.
    """
    lo, hi = window
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"window must be two fractions 0 <= start < end <= 1, got {tuple(window)}")
    events = gpu_events(trace)
    if not events:
        raise ValueError("the trace holds no GPU kernels (was it recorded with ProfilerActivity.CUDA?)")
    t0 = events[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in events) - t0
    a, b = t0 + lo * span, t0 + hi * span
    shown = [e for e in events if e["ts"] < b and e["ts"] + e["dur"] > a]
    streams = sorted({e["stream"] for e in events}, key=str)
    left, top = 90, 40
    plot = width - left - 20
    height = top + lane * len(streams) + 60
    scale = plot / (b - a)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="20" font-size="14">{html.escape(title)} '
             f'({(b - a) / 1e3:.2f} ms shown of {span / 1e3:.2f} ms)</text>']
    for i, s in enumerate(streams):
        y = top + i * lane
        parts.append(f'<text x="5" y="{y + lane * 0.65:.1f}">stream {html.escape(str(s))}</text>')
        parts.append(f'<line x1="{left}" x2="{left + plot}" y1="{y + lane - 2}" y2="{y + lane - 2}" '
                     'stroke="#eeeeee"/>')
    for e in shown:
        x0 = left + (max(e["ts"], a) - a) * scale
        x1 = left + (min(e["ts"] + e["dur"], b) - a) * scale
        y = top + streams.index(e["stream"]) * lane + 3
        parts.append(f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.5):.2f}" height="{lane - 8}" '
                     f'fill="{KINDS[e["kind"]]}"><title>{html.escape(e["name"][:120])} '
                     f'{e["dur"]:.1f} us</title></rect>')
    y = top + lane * len(streams) + 25
    for i, (kind, colour) in enumerate(KINDS.items()):
        x = left + i * 130
        parts.append(f'<rect x="{x}" y="{y - 11}" width="14" height="14" fill="{colour}"/>')
        parts.append(f'<text x="{x + 20}" y="{y}">{kind}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dbo.bench.timeline",
                       description="draw a GPU kernel trace's streams as an SVG timeline")
    p.add_argument("trace", help="a torch.profiler Chrome trace (.json, or gzipped: .json.gz)")
    p.add_argument("svg", help="where to write the SVG")
    p.add_argument("--window", type=float, nargs=2, default=(0.4, 0.6), metavar=("START", "END"),
                   help="the fractions of the trace's span to draw (default 0.4 0.6)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    check_writable_file(p, "svg", args.svg)
    try:
        trace = read_chrome_trace(args.trace)
        name = Path(args.trace).name.removesuffix(".gz").removesuffix(".json")
        svg = timeline_svg(trace, window=args.window, title=args.title or name)
    except (OSError, ValueError) as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 2
    write_whole(args.svg, svg)
    print(f"{p.prog}: wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m dbo.bench.timeline", main))
