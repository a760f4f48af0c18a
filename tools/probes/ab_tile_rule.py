"""Whole experts calls with the library's tile rule against another version of it, alternating.

``--rule FILE`` is a copy of ``dbo/experts/kernels/fused_tiles.py`` from another revision (``git show
REV:dbo/experts/kernels/fused_tiles.py > FILE``); its ``pick_configs`` (and ``pick_slab_configs``,
where it has one) stand in for the library's during the ``B`` calls. For each shape, STANDARD
(``I:L:T``: ``T`` received tokens, top-8 of 256, device offsets) and low-latency slabs
(``bI:L:T``: ``T`` tokens per rank of 2), both timed by :func:`dbo.bench.experts.command.time_experts`
(each call behind a GPU sleep, alternating); prints B's time over A's, each against the limit,
and B's output error against A's.

    python tools/probes/ab_tile_rule.py --rule before.py --shapes 2048:32:4096 b2048:8:256
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo.bench.experts.command import add_limits, make_batched_case, make_case, time_experts  # noqa: E402
from dbo.bench.experts.record import ExpertsRow, ImplTiming  # noqa: E402
from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.experts import SwiGLUExperts  # noqa: E402
from dbo.experts.kernels import batched, fused_experts  # noqa: E402


class RuleExperts(SwiGLUExperts):
    """The library's experts with another revision's tile rules in force during each call:
    ``pick`` is its ``(pick_configs, pick_slab_configs)`` (a revision without the second: its
    ``pick_configs`` for both)."""

    def __init__(self, pick, **kw):
        super().__init__(**kw)
        self.pick = pick

    def apply(self, *args, **kwargs):
        saved = fused_experts.pick_configs, batched.pick_slab_configs
        fused_experts.pick_configs, batched.pick_slab_configs = self.pick
        try:
            return super().apply(*args, **kwargs)
        finally:
            fused_experts.pick_configs, batched.pick_slab_configs = saved


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rule", required=True)
    p.add_argument("--shapes", nargs="+", required=True, metavar="[b]I:L:T")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("rule_b", a.rule)
    rule = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rule  # its dataclasses look their module up there
    spec.loader.exec_module(rule)
    picks = (rule.pick_configs, getattr(rule, "pick_slab_configs", rule.pick_configs))
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    ratios = []
    with torch.inference_mode():
        for shape in a.shapes:
            slabs = shape.startswith("b")
            inter, n_local, t = (int(v) for v in shape.lstrip("b").split(":"))
            if slabs:
                case = make_batched_case(t, 7168, inter, n_local, ranks=2, seed=t)
                counts = case.counts_cpu
            else:
                case = make_case(t, 7168, inter, n_local, seed=t)
                counts = case.counts
            impls = {"A": (SwiGLUExperts(num_global_experts=None if slabs else 256), False),
                     "B": (RuleExperts(picks, num_global_experts=None if slabs else 256), False)}
            res = time_experts(impls, case, steps=a.steps, timings=("device",))
            row = ExpertsRow(layout="batched" if slabs else "standard", hidden=7168, intermediate=inter,
                             local_experts=n_local, tokens=t, local_pairs=int(counts.sum()),
                             experts_with_rows=int((counts > 0).sum()),
                             results={name: ImplTiming(**v) for name, v in res.items()})
            (row,) = add_limits([row], lim)
            ra, rb = row.results["A"], row.results["B"]
            r = rb.median_ms / ra.median_ms
            ratios.append(r)
            print(f"{shape}: {row.local_pairs / n_local:.0f} rows/expert; A {ra.median_ms:.3f} ms "
                  f"({ra.x_limit:.2f}x limit), B {rb.median_ms:.3f} ms ({rb.x_limit:.2f}x); "
                  f"B/A {r:.3f}; B's error {rb.rel_err:.1e}", flush=True)
            del case
            torch.cuda.empty_cache()
    print(f"B/A geometric mean {statistics.geometric_mean(ratios):.3f} over {len(ratios)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
