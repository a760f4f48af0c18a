"""How much of a short experts call is its kernels' boundaries: the library's whole call against
the same work cut into two chains that the GPU may run side by side, on the GPU host.

Where the rows per expert are few (the grid's T <= 4096 rows), each call is a few kernels that
stream the weights; each kernel starts with a ramp (the first loads in flight) and ends with a
tail (its last programs), and the next one cannot start before. Two independent chains of
kernels on two streams fill each other's ramps and tails. The probe times, behind a GPU sleep,
alternating:

* ``lib``: the library's call (:class:`dbo.moe.SwiGLUExperts`);
* ``halves``: the local experts cut in two halves, each half a whole fused call (routing,
  both GEMMs, its own top-k sum into its own output), one after the other on one stream;
* ``halves2``: the same two calls, the second on a side stream (forked and joined with events);
* ``twice`` / ``twice2``: two whole library-size calls, serial / side by side (how much the
  device has left when one call runs: ``twice2 / twice`` near 1 means none).

Each call is queued behind a GPU sleep of 2 ms of its own (a round of these calls takes the
host longer to launch than the GPU to run).

``halves2 / halves`` bounds what overlapping the kernels' boundaries within one call could gain
(the halves pay a second routing and top-k sum, so it understates it slightly); the halves'
outputs are checked (summed) against the library's.

    python3 tests/gpu/probe_two_chains.py [--json out.json] [--reps 20] [--shapes I:L:T ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import experts_call, make_case  # noqa: E402
from dbo.bench.limits import experts_cost  # noqa: E402
from dbo.moe.fused_experts import fused_swiglu_experts  # noqa: E402

#: (I, local experts, tokens): the grid's short rows (32-128 rows per expert)
SHAPES = [(i, n, t) for i in (256, 768, 2048) for n in (32, 128) for t in (1024, 2048, 4096)] + \
    [(256, 256, 1024), (256, 256, 2048)]


#: a side stream per device, for the second chain
_SIDE: dict = {}


def _forked(first, second):
    # second on a side stream, first on the caller's, joined before returning
    main = torch.cuda.current_stream()
    if main.device not in _SIDE:  # (setdefault would make a stream on every call)
        _SIDE[main.device] = torch.cuda.Stream(device=main.device)
    side = _SIDE[main.device]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        second()
    first()
    main.wait_stream(side)


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case = make_case(t, hidden, inter, local, seed=t)
    case2 = make_case(t, hidden, inter, local, seed=t + 1)
    h = local // 2
    est = t * topk / 256  # as the library estimates (the global expert count known)
    ids = case.ids
    halves = []
    for lo, hi in ((0, h), (h, local)):
        ids_h = torch.where((ids >= lo) & (ids < hi), ids - lo, -1).to(ids.dtype)
        w1, w2 = case.w1[lo:hi], case.w2[lo:hi]
        out = torch.empty_like(case.x)
        halves.append((w1, w2, ids_h, out))

    def half(k):
        w1, w2, ids_h, out = halves[k]
        return lambda: fused_swiglu_experts(case.x, w1, w2, case.weights, ids_h, out=out, rows_per_expert=est)

    lib, lib2 = experts_call(case), experts_call(case2)
    a, b = half(0), half(1)
    fns = {"lib": lib,
           "halves": lambda: (a(), b()),
           "halves2": lambda: _forked(a, b),
           "twice": lambda: (lib(), lib2()),
           "twice2": lambda: _forked(lib, lib2)}
    want = lib().float()
    fns["halves2"]()
    torch.cuda.synchronize()
    got = halves[0][3].float() + halves[1][3].float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    ms = alternating_ms(fns, reps, rotate=True, sleep_each_ms=2.0)
    flops, nbytes = experts_cost(hidden=hidden, intermediate=inter, local_pairs=int(case.counts.sum()),
                                 experts_with_rows=int((case.counts > 0).sum()))
    return {"I": inter, "L": local, "T": t, "ms": ms, "rel_err": err,
            "x_limit": ms["lib"] / lim.time_ms(flops, nbytes),
            "halves2/halves": ms["halves2"] / ms["halves"], "halves2/lib": ms["halves2"] / ms["lib"],
            "twice2/twice": ms["twice2"] / ms["twice"]}


def _line(r: dict) -> str:
    ms = r["ms"]
    return (f"I={r['I']:>4} L={r['L']:>3} T={r['T']:>5} | lib {ms['lib']:.3f} ms ({r['x_limit']:.2f}x) | "
            f"halves {ms['halves']:.3f} halves2 {ms['halves2']:.3f} -> {r['halves2/halves']:.3f}, "
            f"/lib {r['halves2/lib']:.3f} | twice {ms['twice']:.3f} twice2 {ms['twice2']:.3f} -> "
            f"{r['twice2/twice']:.3f} | err {r['rel_err']:.1e}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, limits=True))
