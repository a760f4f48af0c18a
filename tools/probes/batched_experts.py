"""The routed experts on DeepEP low-latency's slabs (``[L, cap, hidden]``, counts on the device)
at decode sizes, against the hardware limit measured in the same run.

For each shape (local experts ``L`` of ``L * ranks``, top-8, ``T`` tokens per rank, every rank
sending as many; hidden 7168, I 2048 unless told) it times, alternating call by call behind a
GPU sleep (CUDA events, median):

* ``one``: the library's call on the whole batch's slabs (``cap = T * ranks``), as the plain
  forward runs it;
* ``split``: two calls, each on one ubatch's slabs (half the tokens), as the split schedule runs
  them; its floor is the limit with every weight read twice;
* ``merged``: the merged schedule's experts as the library runs them at its rendezvous
  (:func:`dbo.moe.merged.run_merged`: the merge, one :class:`dbo.experts.SwiGLUExperts` call, the
  split): on the fused kernels the ubatches' slabs are segments of one flat buffer (only the
  rows that arrived copied in, nothing copied back);
* ``merged_call``: that experts call alone, on the merged input;
* with ``--sweep``, each gate/up and down tile of a short list alone, to find the best tile of
  each GEMM at each shape (the library's own first).

The limit is ``max(bytes / copy rate, flops / GEMM rate)`` with the bytes of the weights of the
experts that got rows and the rows in and out (:func:`dbo.bench.limits.experts_cost`).
:func:`runners` builds the four callables for any device (the CPU tests run them under Triton's
interpreter).

    python tools/probes/batched_experts.py --json $OUT/batched.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms  # noqa: E402

from dbo.bench.limits import experts_cost, measure_device_limits  # noqa: E402
from dbo.experts import SwiGLUExperts, relative_error  # noqa: E402
from dbo.experts.kernels.batched import batched_order, batched_swiglu_experts  # noqa: E402
from dbo.experts.kernels.fused_experts import launch_down, launch_gate_up  # noqa: E402
from dbo.experts.kernels.fused_tiles import GemmConfig as C  # noqa: E402
from dbo.experts.kernels.fused_tiles import pick_slab_configs  # noqa: E402
from dbo.moe import ActivationFormat, ExpertTokensMetadata, Workspace  # noqa: E402
from dbo.moe.merged import ExpertsInput, merge_inputs, run_merged  # noqa: E402

UP = [C(64, 128, 64, 8, 4, 5, tma=True), C(64, 64, 64, 8, 4, 5, tma=True),
      C(64, 256, 64, 8, 8, 3, tma=True), C(128, 128, 64, 8, 8, 4, tma=True, tail_m=32),
      C(128, 64, 64, 8, 4, 4, tma=True, tail_m=32), C(64, 128, 64, 8, 4, 5, ws=True),
      C(128, 128, 64, 8, 8, 4, ws=True), C(64, 128, 64, 8, 4, 5, ws=True, split=4),
      C(64, 32, 128, 8, 4, 4, tma=True), C(64, 128, 64, 8, 4, 5, ws=True, split=2),
      C(64, 128, 64, 8, 4, 5, ws=True, split=8), C(64, 128, 64, 8, 4, 4, ws=True, split=4)]
DOWN = [C(64, 128, 64, 8, 4, 4, tma=True), C(64, 64, 64, 8, 4, 6, tma=True),
        C(128, 256, 64, 8, 8, 4, tma=True, tail_m=32), C(128, 128, 64, 8, 4, 3, flat=True),
        C(64, 128, 64, 8, 4, 3, flat=True), C(128, 256, 64, 8, 8, 3, flat=True),
        C(64, 256, 64, 8, 4, 4, flat=True), C(64, 64, 128, 8, 4, 4, tma=True),
        C(64, 256, 64, 8, 4, 5, flat=True), C(128, 256, 64, 8, 8, 4, flat=True),
        C(64, 256, 64, 8, 8, 4, flat=True)]


BATCHED = ActivationFormat.BATCHED_EXPERTS


def slabs(counts: torch.Tensor, cap: int, hidden: int, gen: torch.Generator,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    x = torch.zeros(counts.numel(), cap, hidden, dtype=dtype, device=gen.device)
    for e, c in enumerate(counts.tolist()):
        x[e, :c] = torch.randn(c, hidden, generator=gen, device=gen.device, dtype=dtype)
    return x


def route_counts(tokens: int, n_global: int, n_local: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Rows each of the first ``n_local`` experts gets from ``tokens`` tokens routed uniformly."""
    scores = torch.rand(tokens, n_global, generator=gen, device=gen.device)
    ids = scores.topk(topk, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=n_global)[:n_local].to(torch.int32)


def runners(inter: int, n_local: int, t: int, ranks: int, hidden: int = 7168, topk: int = 8,
            device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """The timed callables (``one``, ``split``, ``merged``, ``merged_call``) of one shape, and
    the case they run on: the slabs, counts and weights, the split's outputs (``outs``) and
    ``merged_outs()``, the merged schedule's per-ubatch outputs. On the CPU the experts run
    under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    gen = torch.Generator(device=device).manual_seed(t * 131 + n_local)
    n_global = n_local * ranks
    half = [route_counts(t * ranks // 2, n_global, n_local, topk, gen) for _ in range(2)]
    counts = half[0] + half[1]
    cap, cap_u = t * ranks, t * ranks // 2
    x = slabs(counts, cap, hidden, gen, dtype)
    xu = [slabs(c, cap_u, hidden, gen, dtype) for c in half]
    kw = dict(device=device, dtype=dtype, generator=gen)
    w1 = torch.randn(n_local, 2 * inter, hidden, **kw) / hidden ** 0.5
    w2 = torch.randn(n_local, hidden, inter, **kw) / inter ** 0.5
    est = t * topk / n_local  # as SwiGLUExperts estimates from the rank's own top-k ids
    out = torch.empty_like(x)
    outs = [torch.empty_like(v) for v in xu]
    # the merged schedule as ExpertsRendezvous runs it: each ubatch's received slab, its
    # counts and its own top-k ids (half the rank's tokens), merged, one experts call, split
    experts = SwiGLUExperts(use_triton=True if torch.device(device).type == "cpu" else None)
    workspace = Workspace()
    ids = torch.zeros(t // 2, topk, dtype=torch.int64, device=device)
    inputs = [ExpertsInput(xu[u], None, ExpertTokensMetadata(half[u]), ids, None) for u in range(2)]
    segmented = experts.accepts_batched_segments(xu[0])

    def compute(m: ExpertsInput) -> torch.Tensor:
        return experts.apply(m.a1q, w1, w2, m.topk_weights, m.topk_ids, activation_format=BATCHED,
                             expert_tokens_meta=m.expert_tokens_meta,
                             apply_router_weight_on_input=False, workspace=workspace)

    merged_in, _ = merge_inputs(BATCHED, inputs, segmented=segmented)
    last: list[list[torch.Tensor]] = []

    def one():
        batched_swiglu_experts(x, w1, w2, counts, out=out, rows_per_expert=est)

    def split():
        for u in range(2):
            batched_swiglu_experts(xu[u], w1, w2, half[u], out=outs[u], rows_per_expert=est / 2)

    def merged():
        last[:] = [run_merged(BATCHED, inputs, compute, segmented=segmented)]

    def merged_call():
        compute(merged_in)

    def merged_outs() -> list[torch.Tensor]:
        merged()
        return last[0]

    case = dict(x=x, w1=w1, w2=w2, counts=counts, half=half, est=est, outs=outs,
                merged_outs=merged_outs, segmented=segmented)
    return {"one": one, "split": split, "merged": merged, "merged_call": merged_call}, case


def merged_vs_split(fns: dict, case: dict) -> float:
    """The largest relative error, over experts and ubatches, of the merged schedule's output
    rows against the split's (the same rows, computed with one weight read)."""
    fns["split"]()
    got = case["merged_outs"]()
    return max(relative_error(got[u][e, :c], case["outs"][u][e, :c])
               for u, h in enumerate(case["half"]) for e, c in enumerate(h.tolist()) if c)


def one_shape(lim, inter: int, n_local: int, t: int, ranks: int, reps: int, sweep: bool,
              hidden: int = 7168, topk: int = 8) -> dict:
    fns, case = runners(inter, n_local, t, ranks, hidden, topk)
    counts, half = case["counts"], case["half"]
    # a GPU sleep before each call keeps the host's launches ahead of the GPU: the merged path's
    # Python (the merge, the experts' apply) would otherwise show in sub-millisecond calls
    times = alternating_ms(fns, reps, rotate=True, sleep_each_ms=2.0)
    pairs, active = int(counts.sum()), int((counts > 0).sum())
    limit = lim.time_ms(*experts_cost(hidden=hidden, intermediate=inter, local_pairs=pairs,
                                      experts_with_rows=active))
    floor = sum(lim.time_ms(*experts_cost(hidden=hidden, intermediate=inter, local_pairs=int(c.sum()),
                                          experts_with_rows=int((c > 0).sum()))) for c in half)
    check = merged_vs_split(fns, case)
    up_cfg, down_cfg = pick_slab_configs(case["est"], inter, n_local)
    row = {"I": inter, "L": n_local, "T": t, "ranks": ranks, "rows_per_expert": pairs / n_local,
           "limit_ms": limit, "split_floor_ms": floor, **{f"{k}_ms": v for k, v in times.items()},
           "one_x_limit": times["one"] / limit, "split_x_floor": times["split"] / floor,
           "split_x_one": times["split"] / times["one"], "merged_x_one": times["merged"] / times["one"],
           "merged_call_x_one": times["merged_call"] / times["one"], "merged_vs_split_rel_err": check,
           "merged_segments": case["segmented"], "up": repr(up_cfg), "down": repr(down_cfg)}
    if sweep:
        row["sweep"] = sweep_tiles(case["x"], case["w1"], case["w2"], counts, up_cfg, down_cfg, inter,
                                   hidden, reps)
    return row


def sweep_tiles(x, w1, w2, counts, up_lib, down_lib, inter, hidden, reps) -> dict:
    n_local, cap, _ = x.shape
    pairs = n_local * cap
    order, offsets = batched_order(counts, cap)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    flat = x.view(pairs, hidden)
    ups = {"lib " + repr(up_lib): up_lib, **{repr(c): c for c in UP if c != up_lib}}
    downs = {"lib " + repr(down_lib): down_lib, **{repr(c): c for c in DOWN if c != down_lib}}
    res = {"up": {}, "down": {}}
    fns = {}
    for name, cfg in ups.items():
        fns[name] = (lambda c=cfg: launch_gate_up(flat, order, offsets, w1, act, c, pairs, 1, True))
    res["up"] = _safe_alternating(fns, reps)
    launch_gate_up(flat, order, offsets, w1, act, up_lib, pairs, 1, True)
    fns = {}
    for name, cfg in downs.items():
        fns[name] = (lambda c=cfg: launch_down(act, order, offsets, w2, y, c, pairs, True))
    res["down"] = _safe_alternating(fns, reps)
    return res


def _safe_alternating(fns: dict, reps: int) -> dict:
    ok = {}
    for k, f in fns.items():
        try:
            f()
            torch.cuda.synchronize()
            ok[k] = f
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile here is reported
            print(f"  {k}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return alternating_ms(ok, reps, rotate=True, sleep_each_ms=2.0) if ok else {}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--intermediate", type=int, nargs="+", default=[2048])
    p.add_argument("--local-experts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512], help="per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    rows = []
    with torch.inference_mode():
        for inter in a.intermediate:
            for n_local in a.local_experts:
                for t in a.tokens:
                    r = one_shape(lim, inter, n_local, t, a.ranks, a.reps, a.sweep)
                    rows.append(r)
                    print(f"I={inter} L={n_local} T={t}: {r['rows_per_expert']:.0f} rows/expert, "
                          f"one {r['one_ms']:.3f} ms = {r['one_x_limit']:.2f}x limit; split "
                          f"{r['split_ms']:.3f} = {r['split_x_floor']:.2f}x its floor, "
                          f"{r['split_x_one']:.2f}x one; merged {r['merged_ms']:.3f} = "
                          f"{r['merged_x_one']:.2f}x one (call alone {r['merged_call_x_one']:.2f}x, "
                          f"{'segments' if r['merged_segments'] else 'packed'}); "
                          f"rel err {r['merged_vs_split_rel_err']:.1e}", flush=True)
                    for g in ("up", "down"):
                        s = r.get("sweep", {}).get(g)
                        if s:
                            best = min(s, key=s.get)
                            lib = next(k for k in s if k.startswith("lib"))
                            print(f"   {g}: lib {s[lib]:.3f} ms, best {s[best]:.3f} {best}", flush=True)
                    torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
