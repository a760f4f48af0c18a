"""What overlap schedules can reach on one MoE layer: the period per layer of each candidate
schedule (tools/probes/period_model.py), from measured part times, or the table of the
candidates at the project's measured shapes (docs/schedules.md, "Candidates, modelled").

    python tools/probes/dbo_period.py --experts-ms 22.2 --attn-ms 5.7 --link-ms 23.05
    python tools/probes/dbo_period.py ... --shared-ms 0.3 --split 1.05 --latency-ms 0.005 \\
        --groups 2 --combine-bytes 1.81 --schedules dbo sbo
    python tools/probes/dbo_period.py --table

The part times are per layer for the whole batch of one rank, as `dbo.bench overlap` prints them
(`compute` = attention and the rest + experts + shared expert, `comm` = dispatch + combine, taken
as half each unless --dispatch-ms says otherwise). Prints, per schedule, the period per layer and
its speedup over serial (compute + comm) and against the bound max(compute, comm). No GPU:
arithmetic only.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from period_model import SCHEDULES, Parts, partial_sum_bytes_factor, simulate  # noqa: E402

# (column, schedule, expert groups) of the table
TABLE_COLUMNS = (("plain", "plain", 1), ("dbo", "dbo", 1), ("dbo-2comm", "dbo-2comm", 1),
                 ("dbo-attn", "dbo-attn", 1), ("dbo-attn-2comm", "dbo-attn-2comm", 1),
                 ("sbo G=2", "sbo", 2), ("sbo G=4", "sbo", 4), ("sbo+dbo G=2", "sbo+dbo", 2))
# 2 ranks of 256 experts, top-8: the sender of copy_engine and deepep_ht sums a token's local
# experts, so grouped combines send more rows (partial_sum_bytes_factor); deepep_ll does not
PREFILL_EXPERTS = (128, 256, 8)


def _prefill(comm: float, latency: float = 0.0) -> Parts:
    # 2 ranks, T=16384 per rank, I=256, attention width 1024: compute 5.94 ms (2 H200s); routed
    # experts ~2.9 ms of it (the 4-H100 trace's gate/up, 1.35 ms a layer, scaled by the one-H200
    # breakdown's gate/up : down : top-k sum, 208 : 147 : 85), the shared expert (I=256) ~0.3 ms,
    # the rest attention and dense parts; split compute 6.24 / 5.94
    return Parts(attn=2.74, experts=2.9, shared=0.3, dispatch=comm / 2, combine=comm / 2,
                 latency=latency, split=6.24 / 5.94)


def _decode(serial: float, comm_share: float, experts_share: float, split: float,
            latency: float = 0.0) -> Parts:
    comm = serial * comm_share
    compute = serial - comm
    return Parts(attn=compute * (1 - experts_share), experts=compute * experts_share,
                 dispatch=comm / 2, combine=comm / 2, latency=latency, split=split)


# (row label, parts, (local experts, experts, top-k) where grouped combines carry partial sums)
CASES: tuple[tuple[str, Parts, tuple[int, int, int] | None], ...] = (
    ("prefill NVLink copy_engine T=16384 I=256", _prefill(2.12), PREFILL_EXPERTS),
    ("prefill NVLink deepep_ht T=16384 I=256", _prefill(2.02), PREFILL_EXPERTS),
    # 50 GB/s + 5 us, 7/8 remote, copy_engine: comm from the measured bound,
    # (5.94 + comm) / comm = 1.57
    ("prefill 50 GB/s T=16384 I=256", _prefill(5.94 / 0.57, latency=0.005), PREFILL_EXPERTS),
    # 4 ranks, 50 GB/s, deepep_ht, I=2048: the DBO step's own expert and other compute times,
    # the comm alone (docs/multihost.md); 64 local experts
    ("prefill 50 GB/s T=16384 I=2048, 4 ranks",
     Parts(attn=5.7, experts=22.2, dispatch=23.05 / 2, combine=23.05 / 2, latency=0.005),
     (64, 256, 8)),
    # 2 H200s, deepep_ll, 128 local experts, I=2048, CUDA graphs: comm ~10% of the layer, the
    # experts' weight read ~90% of the compute, split compute 1.70-1.89x plain (1.8 here)
    ("decode NVLink T=64", _decode(2.46, 0.10, 0.9, 1.8), None),
    ("decode NVLink T=256", _decode(3.00, 0.10, 0.9, 1.8), None),
    ("decode NVLink T=512", _decode(3.33, 0.10, 0.9, 1.8), None),
    # 2 H100s, 25 GB/s + 10 us, 8 local experts, graph serial and the eager comm share
    # (docs/multihost.md); the experts ~70% of the compute; split compute 2.1-2.3x (2.2 here)
    ("decode 25 GB/s T=64", _decode(0.68, 0.30, 0.7, 2.2, latency=0.010), None),
    ("decode 25 GB/s T=256", _decode(1.60, 0.65, 0.7, 2.2, latency=0.010), None),
    ("decode 25 GB/s T=512", _decode(2.94, 0.71, 0.7, 2.2, latency=0.010), None),
)


def table(layers: int = 40) -> str:
    """The candidates' speedups over serial (compute + comm) at the project's measured shapes."""
    head = ["case", "compute", "comm", "bound"] + [c for c, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, p, experts in CASES:
        serial = p.compute + p.comm
        cells = [label, f"{p.compute:.2f}", f"{p.comm:.2f}",
                 f"{serial / max(p.compute, p.comm):.2f}x"]
        for _, name, groups in TABLE_COLUMNS:
            grouped = p if experts is None or groups == 1 else \
                replace(p, combine_bytes=partial_sum_bytes_factor(groups, *experts))
            cells.append(f"{serial / simulate(name, grouped, layers, groups):.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="print the candidates at the measured shapes")
    p.add_argument("--experts-ms", type=float, help="routed experts per layer, whole batch")
    p.add_argument("--attn-ms", type=float,
                   help="the rest of the compute per layer (attention, router, dense parts)")
    p.add_argument("--link-ms", type=float, help="dispatch + combine per layer (comm)")
    p.add_argument("--dispatch-ms", type=float, help="the dispatch's share of --link-ms (default half)")
    p.add_argument("--shared-ms", type=float, default=0.0, help="shared expert per layer")
    p.add_argument("--latency-ms", type=float, default=0.0, help="latency included in each transfer")
    p.add_argument("--split", type=float, default=1.0,
                   help="factor on a ubatch's compute when the batch is split in two")
    p.add_argument("--groups", type=int, default=2, help="expert groups of the sbo schedules")
    p.add_argument("--combine-bytes", type=float, default=1.0,
                   help="combine bytes with grouped experts over one combine (partial sums)")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--schedules", nargs="+", choices=tuple(SCHEDULES), default=list(SCHEDULES))
    a = p.parse_args(argv)
    if a.layers < 12:
        p.error(f"--layers must be >= 12, got {a.layers}")
    if a.table:
        print(table(a.layers))
        return 0
    if None in (a.experts_ms, a.attn_ms, a.link_ms):
        p.error("give --experts-ms, --attn-ms and --link-ms, or --table")
    dispatch = a.link_ms / 2 if a.dispatch_ms is None else a.dispatch_ms
    try:
        parts = Parts(attn=a.attn_ms, experts=a.experts_ms, shared=a.shared_ms, dispatch=dispatch,
                      combine=a.link_ms - dispatch, latency=a.latency_ms, split=a.split,
                      combine_bytes=a.combine_bytes)
    except ValueError as e:
        p.error(str(e))
    if a.groups < 1:
        p.error(f"--groups must be >= 1, got {a.groups}")
    serial = parts.compute + parts.comm
    bound = max(parts.compute, parts.comm)
    print(f"per layer: compute {parts.compute:.2f} ms, link {parts.comm:.2f} ms, serial "
          f"{serial:.2f} ms, bound max(compute, link) {bound:.2f} ms ({serial / bound:.3f}x serial)")
    for name in a.schedules:
        period = simulate(name, parts, a.layers, a.groups)
        print(f"{name:>14}: {period:7.2f} ms per layer, {serial / period:.3f}x serial, "
              f"{period / bound:.3f}x the bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
