"""What the fused experts' structure can reach at best, against the experts benchmark's limit.

    python tests/gpu/floor_experts.py [--gemm-fraction 0.82] [--bandwidth 4.27e12 --rate 800e12]

Runs anywhere (no GPU): a model, not a measurement. Per row of the experts grid (hidden 7168,
top-8 of 256, I 256/768/2048, 32/128/256 local experts, 1024..65536 tokens) it adds up each
kernel of :mod:`dbo.moe.fused_experts` at its own best: the gate/up GEMM (reads the weights of
the experts with rows, the gathered rows, writes ``[pairs, I]``), the down GEMM (reads its
weights and ``[pairs, I]``, writes ``[pairs, hidden]``), each at ``max(bytes / bandwidth, flops
/ (gemm_fraction * rate))``, and the top-k sum (reads ``[pairs, hidden]``, writes ``[T,
hidden]``) at full bandwidth, plus 15 us of routing; and prints the sum over the benchmark's
limit (:func:`dbo.bench.limits.experts_cost`). ``gemm_fraction`` is the share of the large-GEMM
rate that a grouped GEMM reaches on these shapes: 0.77-0.85 for cuBLAS's batched GEMM with equal
groups on an H200 (docs/perf_notes.md section 5c). The geometric mean it prints is the floor
of the benchmark's geometric mean for kernels of this structure.
"""

from __future__ import annotations

import argparse
import math

from dbo.bench.limits import active_experts, experts_cost


def floor_ratio(inter: int, local: int, tokens: int, *, hidden: int = 7168, topk: int = 8,
                num_experts: int = 256, bandwidth: float, rate: float, gemm_fraction: float) -> float:
    pairs = tokens * topk * local / num_experts
    with_rows = active_experts(local, pairs)
    flops, num_bytes = experts_cost(hidden=hidden, intermediate=inter, local_pairs=int(pairs),
                                    experts_with_rows=with_rows)
    limit = max(flops / rate, num_bytes / bandwidth)
    w = with_rows * hidden * inter * 2  # one matrix of every expert with rows, bf16
    eff = gemm_fraction * rate
    gate_up = max(4 * pairs * hidden * inter / eff, (2 * w + pairs * (hidden + inter) * 2) / bandwidth)
    down = max(2 * pairs * hidden * inter / eff, (w + pairs * (hidden + inter) * 2) / bandwidth)
    topk_sum = (pairs + tokens) * hidden * 2 / bandwidth
    return (gate_up + down + topk_sum + 15e-6) / limit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gemm-fraction", type=float, default=0.82)
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s")
    p.add_argument("--rate", type=float, default=800e12, help="bf16 flop/s of a large GEMM")
    a = p.parse_args()
    rows = {}
    for inter in (256, 768, 2048):
        for local in (32, 128, 256):
            for tokens in (1024 << i for i in range(7)):
                rows[inter, local, tokens] = floor_ratio(inter, local, tokens, bandwidth=a.bandwidth,
                                                         rate=a.rate, gemm_fraction=a.gemm_fraction)

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    for inter in (256, 768, 2048):
        xs = [r for k, r in rows.items() if k[0] == inter]
        print(f"I={inter:>4}: floor geometric mean {geo(xs):.2f}x the limit, worst {max(xs):.2f}x")
    print(f"all {len(rows)} rows: floor geometric mean {geo(list(rows.values())):.2f}x the limit, "
          f"worst {max(rows.values()):.2f}x (GEMMs at {a.gemm_fraction:.2f} of the rate)")


if __name__ == "__main__":
    main()
