"""The library's experts against an earlier version of its fused kernels, in one run.

    python3 tests/gpu/ab_experts.py OLD_FUSED_EXPERTS.py [--tokens ...] [--json out.json]

``OLD_FUSED_EXPERTS.py`` is a copy of an earlier ``dbo/moe/fused_experts.py`` (e.g. ``git show
REV:dbo/moe/fused_experts.py > old.py``). It imports the library's tile table and kernels; to
compare with an earlier tile table too, copy that table beside it and import it instead:

    git show REV:dbo/moe/fused_tiles.py > .whl/old_tiles.py
    git show REV:dbo/moe/fused_experts.py | sed 's/^from dbo.moe.fused_tiles import/from old_tiles import/' \
        > .whl/old_fe.py
    PYTHONPATH=$PWD/.whl:$PYTHONPATH python3 tests/gpu/ab_experts.py .whl/old_fe.py
 Over the experts benchmark's grid (or the given
sizes), each shape times the library's :class:`dbo.moe.SwiGLUExperts` as it is and with the old
module's ``fused_swiglu_experts`` swapped in (everything else, the routing choice and the tiles
included, the same), alternating step by step, and prints both against the hardware limit
measured at the start of the run. Shapes where the unfused steps run time the same code twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

import dbo.moe.experts as experts_mod
from dbo.bench.experts import add_limits, format_rows, limit_summary, run_grid
from dbo.bench.limits import measure_device_limits
from dbo.moe import MoEExperts, SwiGLUExperts


class _Swapped(MoEExperts):
    """SwiGLUExperts with another ``fused_swiglu_experts`` for the duration of each call."""

    def __init__(self, fused_fn):
        self.inner = SwiGLUExperts(num_global_experts=256)
        self.fused_fn = fused_fn

    def supported_activation_formats(self):
        return self.inner.supported_activation_formats()

    def finalize_weight_and_reduce_impl(self):
        return self.inner.finalize_weight_and_reduce_impl()

    def apply(self, *args, **kwargs):
        saved = experts_mod.fused_swiglu_experts
        experts_mod.fused_swiglu_experts = self.fused_fn
        try:
            return self.inner.apply(*args, **kwargs)
        finally:
            experts_mod.fused_swiglu_experts = saved


def _forced(fused_fn, persistent: bool):
    """``fused_fn`` with its grouped GEMMs persistent or not, whatever the policy says."""

    def call(*args, **kw):
        return fused_fn(*args, persistent=persistent, **kw)

    return call


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("old", help="a copy of an earlier dbo/moe/fused_experts.py")
    p.add_argument("--intermediate", type=int, nargs="+", default=[256, 768, 2048])
    p.add_argument("--local-experts", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024 << i for i in range(7)])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--persistent", choices=["always", "never"], default=None,
                   help="also time the library with its GEMMs always (never) persistent")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("old_fused_experts", a.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    limits = measure_device_limits()
    print(limits.describe(), flush=True)
    impls = {"library": (SwiGLUExperts(num_global_experts=256), False),
             "old kernels": (_Swapped(old.fused_swiglu_experts), False)}
    if a.persistent:
        from dbo.moe.fused_experts import fused_swiglu_experts

        impls[f"{a.persistent} persistent"] = (
            _Swapped(_forced(fused_swiglu_experts, a.persistent == "always")), False)
    with torch.inference_mode():
        rows = run_grid(impls, hidden=[7168], intermediate=a.intermediate, tokens=a.tokens,
                        local_experts=a.local_experts, steps=a.steps,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
    add_limits(rows, limits)
    print(format_rows(rows, "old kernels"))
    for name in limit_summary(rows):
        by_i = {}
        for r in rows:
            by_i.setdefault(r["intermediate"], []).append(r["results"][name]["x_limit"])
        print(f"{name}: by I " + ", ".join(
            f"{i}: {torch.tensor(v).log().mean().exp().item():.2f}x" for i, v in by_i.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limits": limits.as_dict(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
