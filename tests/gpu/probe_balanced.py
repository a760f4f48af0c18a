"""How much of a grid row's time is the row tiles' padding: the library's whole call on the grid's
random routing against a routing with exactly as many rows per expert (every expert
``8 * T / 256``), same inputs otherwise, on the GPU host.

Uniform top-k routing gives each expert ``8T/256 +- sqrt(8T/256)`` rows, so at 128 and 256 rows
per expert about half of the experts spill a few rows into one more row tile. The balanced routing
(tokens in groups of 32, each group's 256 slots a random permutation of the 256 experts: every
token still has 8 distinct experts, and with few local experts about as many local slots as
before) has no spills where the rows per expert are a multiple of the tiles' heights. The ratio
of the two times bounds what removing that padding could gain. The outputs are checked against
the unfused reference of the same routing.

    python3 tests/gpu/probe_balanced.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import _apply, make_case  # noqa: E402
from dbo.bench.limits import experts_cost  # noqa: E402
from dbo.moe import SwiGLUExperts, Workspace  # noqa: E402


def balanced_ids(tokens: int, local: int, *, num_experts: int = 256, topk: int = 8, seed: int = 0,
                 device: str = "cuda") -> torch.Tensor:
    """Top-k ids (local ids, ``-1`` elsewhere) giving every expert exactly ``topk * tokens /
    num_experts`` slots (``tokens`` a multiple of ``num_experts // topk``)."""
    group = num_experts // topk
    if tokens % group:
        raise ValueError(f"tokens must be a multiple of {group}, got {tokens}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    perms = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(tokens // group)])
    ids = perms.view(tokens, topk).to(device)
    return torch.where(ids < local, ids, -1).to(torch.int32)


#: (I, local experts, tokens): the grid's rows at 128, 256 and 512 rows per expert
SHAPES = [(i, n, t) for i in (256, 768, 2048) for n in (32, 128, 256) for t in (4096, 8192, 16384)]
#: the last shape's weights, kept for the next shape of the same I and local experts
_weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    hidden = 7168
    w = _weights.pop((inter, local), None)
    _weights.clear()
    case_r = make_case(t, hidden, inter, local, seed=t, weights=w)
    _weights[inter, local] = (case_r.w1, case_r.w2)
    ids = balanced_ids(t, local, seed=t)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=local).to(torch.int32).cpu()
    case_b = dataclasses.replace(case_r, ids=ids, counts=counts, _meta=None)
    lib = SwiGLUExperts(num_global_experts=256)
    ref = SwiGLUExperts(num_global_experts=256, fused=False)
    ws_r, ws_b = Workspace(), Workspace()
    fns = {"random": lambda: _apply(lib, case_r, False, ws_r),
           "balanced": lambda: _apply(lib, case_b, False, ws_b)}
    err = {}
    for k, c in (("random", case_r), ("balanced", case_b)):
        got, want = fns[k]().float(), _apply(ref, c, False, Workspace()).float()
        err[k] = float((got - want).norm() / want.norm().clamp_min(1e-30))
    ms = alternating_ms(fns, reps, rotate=True)
    row = {"I": inter, "L": local, "T": t, "ms": ms, "rel_err": err,
           "rows_per_expert": {"random": [int(case_r.counts.min()), int(case_r.counts.max())],
                               "balanced": [int(counts.min()), int(counts.max())]}}
    for k, c in (("random", case_r), ("balanced", case_b)):
        flops, nbytes = experts_cost(hidden=hidden, intermediate=inter, local_pairs=int(c.counts.sum()),
                                     experts_with_rows=int((c.counts > 0).sum()))
        row.setdefault("x_limit", {})[k] = ms[k] / lim.time_ms(flops, nbytes)
    return row


def _line(row: dict) -> str:
    ms, x = row["ms"], row["x_limit"]
    return (f"I={row['I']:>4} L={row['L']:>3} T={row['T']:>5} rows/e {8 * row['T'] // 256:>4} "
            f"(random {row['rows_per_expert']['random']}) | random {ms['random']:.3f} ms "
            f"({x['random']:.2f}x) balanced {ms['balanced']:.3f} ms ({x['balanced']:.2f}x) | "
            f"balanced/random {ms['balanced'] / ms['random']:.3f} | err {max(row['rel_err'].values()):.1e}")


def _summary(rows: list[dict]) -> None:
    gm = statistics.geometric_mean
    for t in sorted({r["T"] for r in rows}):
        sub = [r for r in rows if r["T"] == t]
        ratio = gm([r["ms"]["balanced"] / r["ms"]["random"] for r in sub])
        print(f"T={t}: balanced/random geomean {ratio:.3f}, "
              f"x limit random {gm([r['x_limit']['random'] for r in sub]):.3f} balanced "
              f"{gm([r['x_limit']['balanced'] for r in sub]):.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, reps=20, limits=True, summary=_summary))
