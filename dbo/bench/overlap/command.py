"""Overlap benchmark: how much of the all-to-all dual-batch overlap hides, per MoE layer.

    # GPUs (2 x H200, NCCL); DeepEP installed (pip install -e ".[deepep]")
    torchrun --nproc-per-node 2 -m dbo.bench overlap --device cuda --backend deepep_ht --out DIR
    torchrun --nproc-per-node 2 -m dbo.bench overlap --device cuda --backend deepep_ll \\
        --cuda-graph --out DIR
    # CPU smoke test (gloo, tiny shapes; the backend defaults to all2all there)
    torchrun --nproc-per-node 2 -m dbo.bench overlap --device cpu --quick

For each shape of the grid (tokens per rank x routed-expert intermediate size) it builds a
``--layers``-layer MoE model (:mod:`dbo.bench.overlap.model`: attention stand-in, router, the library's
routed experts behind the backend, shared expert) and measures per layer:

* compute alone: the same layer with the communication replaced by a replay of what the
  backend delivered (same received tokens, same expert kernels);
* communication alone: dispatch + combine of the same routing, no experts, for each
  ``--num-sms`` (DeepEP normal mode's ``Buffer.set_num_sms``);
* serial: the plain forward over the whole batch, for each SM count;
* DBO: two ubatches through ``dbo.overlap.overlapped_forward`` (``run_ubatches``; the backends
  yield around their all-to-all), for each SM count and ``--dbo-sm-carveout``;
* DBO compute alone: the DBO schedule with the replayed communication (the cost of splitting);
* merged and merged compute alone: DBO and DBO compute alone with the merged expert schedule
  (``dbo.expert_schedule``: one experts call per layer over both ubatches' rows);

with CUDA events after warm-up, the median over ``--steps`` steps of the slowest rank, the CPU
launch time of a step (and whether the step waits for the GPU from the host), and the peak
memory of one step. Speedup = best serial / best DBO; overlap efficiency = (serial - DBO) /
min(compute, comm) (:mod:`dbo.bench.overlap.report` has the exact definitions). With ``--cuda-graph``
(deepep_ll) it also captures a whole serial step and a whole DBO step into CUDA graphs and
compares their replays with eager DBO, checking that the outputs are equal.

Every serial and DBO output is checked against the serial one. Rank 0 writes the bundle to
``--out``: ``bench_overlap.json`` (every measurement and the environment), ``bench_overlap.png``
(where matplotlib is installed), ``bench_overlap.trace.json`` (dbo's schedule of one DBO step per
shape; open at https://ui.perfetto.dev), ``gpu_trace_{dbo,serial}.json`` (torch.profiler kernels
of one step of the profiled shape), and prints a short table, then a verdict line that names the
folder: PASS when every output matched, else FAIL (exit code 1). Performance targets missed are warnings; on
the CPU they are notes (gloo runs on the cores that compute, so there is nothing to overlap).
Under ``DBO_DISABLE=1`` every plan is unsplit, so the DBO rows time the plain forward: the table
says so above its rows, marks their speedups ``off``, and the verdict says DBO was disabled.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.backends import make_backend
from dbo.bench.cli import verdict
from dbo.bench.dist import distributed
from dbo.bench.limits import layer_limit_ms, measure_device_limits
from dbo.bench.overlap.args import (
    DTYPES,
    PROG,
    SCHEMA,
    TOLERANCE,
    collect_env,
    configure_deepep,
    count_configs,
    parse_args,
    portable,
    profile_target,
)
from dbo.bench.overlap.capture import GRAPH_BACKENDS, cuda_graph, traces
from dbo.bench.overlap.link import measure_link
from dbo.bench.overlap.model import BenchModel, LayerDims
from dbo.bench.overlap.report import format_table, summarize_shape, write_plot
from dbo.bench.overlap.shape import Budget, ShapeBench
from dbo.bench.overlap.wrapper import restore_carveout, time_wrapper, tune_and_time_wrapper
from dbo.bench.timing import Progress
from dbo.deployment import DeploymentConfig, save_deployment_config
from dbo.split import DISABLE_ENV_VAR, SplitConfig, Vote, dbo_disabled_by_env, local_vote

__all__ = ["run", "main"]


def build_backend(args: argparse.Namespace, tokens: int, device: torch.device, dtype: torch.dtype) -> Any:
    return make_backend(args.backend, None, hidden=args.hidden, num_experts=args.experts,
                        topk=args.topk, max_tokens_per_rank=tokens, dtype=dtype, device=device,
                        link=getattr(args, "link_model", None), **getattr(args, "backend_kwargs", {}))


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device, out_dir: Path,
        env: dict) -> dict:
    dtype = DTYPES[args.dtype]
    # the expert-parallel group the model is built for: the process group, or the emulated one
    ep_world, ep_rank = (args.emulate_ep, args.emulate_rank) if args.emulate_ep else (world, rank)
    budget = Budget(args.time_budget_s, device)
    progress = Progress(count_configs(args), enabled=rank == 0)
    warnings: list[str] = []
    if args.sm_carveout is not None:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            warnings.append("--sm-carveout: this torch has no _set_sm_carveout_experimental")
        else:
            setter(args.sm_carveout)
    # one backend for every shape, except deepep_ll whose capacity is the batch: the first one
    # built is the largest, so the shared DeepEP buffer is sized once
    shared_backend = build_backend(args, max(args.tokens), device, dtype)
    # the ceilings for the compute columns' limit, measured on this device in this run
    limits = measure_device_limits(device)
    env["limits"] = limits.as_dict()
    # the link rate for the comm column's limit, measured on this group in this run
    link = measure_link(None, device)
    env["link"] = None if link is None else link.as_dict()
    if link is not None and rank == 0:
        print(link.describe(), flush=True)
    sim = getattr(args, "link_model", None)
    env["simulated_link"] = None if sim is None else sim.as_dict()
    if sim is not None and args.emulate_ep:
        # an emulated rank counts the remote bytes itself: from the hosts, or --remote-fraction
        env["simulated_link"]["remote_fraction"] = (
            args.remote_fraction if args.remote_fraction is not None
            else 1.0 - min(args.gpus_per_host, args.emulate_ep) / args.emulate_ep)
    if sim is not None and rank == 0:
        print(sim.describe(), flush=True)
    target = profile_target(args)
    shapes, chrome = [], []
    tuned: dict[int, dict] = {}
    # The split decision's all-reduce over NCCL would read its result back on the host, i.e.
    # wait for the GPU every step: decide over a CPU (gloo) group instead, as an engine would.
    decision_group = dist.new_group(backend="gloo") if args.autotune and device.type == "cuda" else None
    try:
        for inter in args.intermediate:
            dims = LayerDims(hidden=args.hidden, intermediate=inter,
                             shared_intermediate=args.shared_intermediate or inter,
                             num_experts=args.experts, topk=args.topk, attn_width=args.attn_width,
                             layers=args.layers, dtype=dtype, attn_yield=args.attn_yield)
            model = BenchModel(dims, ep_rank, ep_world, device, seed=args.seed)
            benches: list[ShapeBench] = []
            for tokens in args.tokens:
                backend = shared_backend
                if args.layout == "deepep_ll" and tokens != max(args.tokens):
                    backend = build_backend(args, tokens, device, dtype)
                dbo_backend = None
                if args.layout == "deepep_ll":
                    dbo_backend = build_backend(args, -(-tokens // 2), device, dtype)
                sb = ShapeBench(args, model, backend, tokens, device, rank, progress, budget,
                                dbo_backend)
                sb.rec["flops_per_token_per_layer"] = dims.flops_per_token()
                sb.link = link
                sb.rec["limit_ms_per_layer"] = layer_limit_ms(
                    limits, tokens=tokens, hidden=dims.hidden, intermediate=inter,
                    shared_intermediate=dims.shared_intermediate, num_experts=dims.num_experts,
                    topk=dims.topk, attn_width=dims.attn_width, world_size=ep_world,
                    dtype_bytes=torch.empty((), dtype=dtype).element_size())
                if not budget.expired():
                    sb.reference()
                    sb.compute_alone()
                    sb.comm_alone()
                    sb.serial_and_dbo()
                    trace = traces(sb, target == (tokens, inter), out_dir)
                    if trace is not None:
                        chrome.append((f"{args.backend} T={tokens} I={inter}", trace))
                    if args.autotune:  # the untuned wrapper: the default config, adaptive
                        time_wrapper(sb, SplitConfig(), decision_group, mode="wrapper_untuned")
                        restore_carveout(args, [sb])
                    if args.cuda_graph:
                        if device.type == "cuda" and args.layout in GRAPH_BACKENDS:
                            cuda_graph(sb)
                        else:
                            sb.rec["cuda_graph"] = {"ok": False, "error": "--cuda-graph needs "
                                                    f"--device cuda and a backend of {GRAPH_BACKENDS}"}
                            progress.update("cuda graph (n/a)")
                else:
                    sb.rec["skipped"] = "time budget"
                backend.reset()
                sb.pf_dbo.reset()
                decode = args.layout == "deepep_ll"
                splits = local_vote(tokens, SplitConfig(), decode_only=decode).vote is Vote.YES
                sb.rec["summary"] = summarize_shape(sb.rec, splits)
                shapes.append(sb.rec)
                benches.append(sb)
                if rank == 0:  # what is done so far survives a later crash or kill
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / "bench_overlap.json").write_text(json.dumps(
                        {"schema": SCHEMA, "partial": True, "env": env, "args": _jsonable(vars(args)),
                         "shapes": shapes}, indent=1, default=str))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if args.autotune:
                tuned[inter] = tune_and_time_wrapper(args, benches, budget, progress, decision_group)
            del model, benches
    finally:
        progress.close()
    if budget.hit:
        warnings.append(f"time budget of {args.time_budget_s:.0f} s reached: some configurations "
                        "were skipped (see 'skipped' in the JSON)")
    configs = {k: v.pop("config", None) for k, v in tuned.items()}
    if args.save_config and rank == 0:
        save_tuned(args, env, configs, warnings, ep_world)
    bundle = {"schema": SCHEMA, "partial": False, "env": env, "args": _jsonable(vars(args)), "shapes": shapes,
              "autotune": {str(k): v for k, v in tuned.items()}, "warnings": warnings, "files": {}}
    finish(bundle, chrome, out_dir, rank)
    return bundle


def save_tuned(args: argparse.Namespace, env: dict, configs: dict, warnings: list[str],
               ep_world: int) -> None:
    """``--save-config``: the autotune's config of the run's one intermediate size, with the
    deployment it was tuned for (:mod:`dbo.deployment`)."""
    config = configs.get(args.intermediate[0])
    if config is None:
        warnings.append(f"--save-config {args.save_config}: the autotune did not finish (time budget?); "
                        "nothing written")
        return
    carveouts = [c for c in args.dbo_sm_carveout if c is not None]
    deployment = {"ep_size": ep_world, "emulated_rank": args.emulate_rank if args.emulate_ep else None,
                  "layout": args.layout, "backend": args.backend, "link": env.get("simulated_link"),
                  "device": env.get("device_name"), "tokens": list(args.tokens),
                  "intermediate": args.intermediate[0], "hidden": args.hidden, "experts": args.experts,
                  "topk": args.topk, "argv": env.get("argv"), "time": env.get("time")}
    save_deployment_config(args.save_config, DeploymentConfig(
        config, sbo_groups=args.sbo_groups, sm_carveout=carveouts[0] if len(carveouts) == 1 else None,
        deployment=deployment))
    print(f"wrote the tuned config to {args.save_config} (DBOWrapper(model, "
          f"load_deployment_config({args.save_config!r})))", flush=True)


def _jsonable(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k != "link_model"}  # in env["simulated_link"]
    return {k: (portable(v, d["out"]) if isinstance(v, str) else
                v if isinstance(v, (int, float, bool, list, dict, type(None))) else str(v))
            for k, v in d.items()}


def _crossovers(bundle: dict) -> list[dict]:
    out = []
    for inter in bundle["args"]["intermediate"]:
        rows = sorted((sh for sh in bundle["shapes"] if sh["intermediate"] == inter),
                      key=lambda sh: sh["tokens"])
        res: dict[str, Any] = {"intermediate": inter}
        for kind, get in (("eager", lambda sh: (sh.get("summary") or {}).get("speedup")),
                          ("graph", lambda sh: (sh.get("cuda_graph") or {}).get("graph_serial_over_dbo"))):
            vals = [(sh["tokens"], get(sh)) for sh in rows]
            if all(v is None for _, v in vals):
                continue
            start = None
            for t, v in reversed(vals):
                if v is None or v <= 1.0:
                    break
                start = t
            res[kind] = start
        out.append(res)
    return out


#: prefixes the notes of a CPU run: its speed targets are expected to be missed
CPU_NOTE = ("on CPU there is nothing to overlap (gloo runs on the cores that compute); the speed "
            "and efficiency targets apply to GPUs")


def finish(bundle: dict, chrome: list[tuple[str, dict]], out_dir: Path, rank: int) -> None:
    """Shape warnings, the crossover, the files and the table (rank 0 writes). On the CPU the
    missed speed targets go to ``bundle["notes"]``, after :data:`CPU_NOTE`, not to the warnings."""
    w = bundle["warnings"]
    cpu = bundle["args"]["device"] == "cpu"
    perf: list[str] = []  # speed targets missed: warnings on GPUs, notes on the CPU
    for sh in bundle["shapes"]:
        label = f"T={sh['tokens']} I={sh['intermediate']}"
        w.extend(sh.get("warnings", []))
        s = sh.get("summary") or {}
        for m in sh["measurements"]:
            t = m.get("timing")
            if t and t["cpu_bound"]:
                w.append(f"{label} {m['mode']} s{m['num_sms']}: CPU launch time "
                         f"{t['cpu_launch_held_ms'] or t['cpu_launch_ms']:.2f} ms is over 80% of the GPU "
                         f"time {t['median_ms']:.2f} ms: Python, not the GPU, sets the pace")
        synced = sorted({m["mode"] for m in sh["measurements"] if (m.get("timing") or {}).get("host_sync")})
        if synced:
            w.append(f"{label}: steps of {', '.join(synced)} wait for the GPU from the host (launch time "
                     "includes those waits; see cpu_launch_* in the JSON)")
        if s.get("peak_ratio") is not None and s["peak_ratio"] > 1.1:
            perf.append(f"{label}: DBO peak memory is {s['peak_ratio']:.2f}x the serial peak (target <= 1.1)")
        if s.get("untuned_wrapper_vs_serial") is not None and s["untuned_wrapper_vs_serial"] > 1.02:
            perf.append(f"{label}: the untuned (adaptive) wrapper is "
                        f"{100 * (s['untuned_wrapper_vs_serial'] - 1):.0f}% slower than serial (limit 2%)")
        if s.get("wrapper_vs_serial") is not None and s["wrapper_vs_serial"] > 1.02:
            who = ("the wrapper with the autotuned config" if s.get("wrapper_measured")
                   else "the default SplitConfig")
            perf.append(f"{label}: {who} is {100 * (s['wrapper_vs_serial'] - 1):.0f}% slower than "
                     "serial (limit 2%)")
        share, eff = s.get("comm_share"), s.get("efficiency")
        if share is not None and eff is not None and share >= 0.25 and eff < 0.6:
            perf.append(f"{label}: communication is {100 * share:.0f}% of the serial layer and the overlap "
                     f"efficiency is {eff:.2f} (target >= 0.6)")
    if bundle["env"].get("dbo_disabled"):  # targets of DBO, which did not run
        perf = [f"{DISABLE_ENV_VAR}=1: DBO was disabled; the speed targets were not checked"]
    if cpu:
        bundle["notes"] = [CPU_NOTE, *perf] if perf else []
    else:
        w.extend(perf)
    bundle["crossover"] = _crossovers(bundle) if bundle["args"].get("layout") == "deepep_ll" else None
    if rank != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    files = bundle["files"]
    if chrome:
        events: list[dict] = []
        for pid, (name, tr) in enumerate(chrome):
            for e in tr["traceEvents"]:
                e = dict(e, pid=pid)
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"{name} (one DBO step, rank 0)"}
                events.append(e)
        path = out_dir / "bench_overlap.trace.json"
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
        files["trace"] = path.name
    for sh in bundle["shapes"]:
        files.update(sh.get("trace_files", {}))
    plot = write_plot(bundle, str(out_dir / "bench_overlap.png"))
    # matplotlib is optional: without it the bundle has no PNG, which is no fault of the run
    files["plot"] = Path(plot).name if plot else None
    files["json"] = "bench_overlap.json"
    (out_dir / "bench_overlap.json").write_text(json.dumps(bundle, indent=1, default=str))


def mismatches(bundle: dict) -> list[str]:
    """The checks whose output differed from the serial reference by more than the tolerance
    (``"T=64 I=64 dbo_sNone: 3.1e-02"``); empty when every output matched."""
    tol = TOLERANCE[DTYPES[bundle["args"]["dtype"]]]
    bad = []
    for sh in bundle["shapes"]:
        label = f"T={sh['tokens']} I={sh['intermediate']}"
        bad.extend(f"{label} {name}: {err['token_median']:.1e}"
                   for name, err in sh.get("checks", {}).items() if not err["token_median"] <= tol)
        g = sh.get("cuda_graph") or {}
        if g.get("ok"):
            bad.extend(f"{label} {name}: {g[name]:.1e}" for name in ("dbo_replay_rel_err",
                                                                      "serial_replay_rel_err")
                       if not g[name] <= tol)
    return bad


def judge(bundle: dict, out_dir: Path) -> tuple[bool, str]:
    """The run's verdict: ``(passed, why)``, ``why`` naming the folder the bundle is in."""
    tol = TOLERANCE[DTYPES[bundle["args"]["dtype"]]]
    where = f"bundle in {out_dir}{'' if str(out_dir).endswith('/') else '/'}"
    bad = mismatches(bundle)
    if bad:
        return False, (f"{len(bad)} output(s) differ from serial by more than {tol:g} "
                       f"({'; '.join(bad[:3])}); {where}")
    checked = sum(len(sh.get("checks", {})) for sh in bundle["shapes"])
    if not checked:
        return False, f"no output was checked (every shape was skipped); {where}"
    if bundle["env"].get("dbo_disabled"):
        return True, (f"{DISABLE_ENV_VAR}=1: DBO was disabled, every DBO row ran the plain forward; "
                      f"{checked} outputs over {len(bundle['shapes'])} shape(s) match the serial "
                      f"reference within {tol:g}; {where}")
    return True, (f"{checked} serial and DBO outputs over {len(bundle['shapes'])} shape(s) match "
                  f"the serial reference within {tol:g}; {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend.startswith("deepep"):
        from dbo.backends.deepep.buffer import DeepEPNotInstalledError, import_deep_ep

        if args.fake_deep_ep:
            from dbo.testing.fake_deep_ep import ensure_fake_deep_ep
            ensure_fake_deep_ep("v1")
        try:  # before the group: every rank stops here alike
            import_deep_ep()
        except DeepEPNotInstalledError as exc:
            sys.stderr.write(f"{PROG}: --backend {args.backend}: {exc}\n")
            return 2
    deepep_setup = configure_deepep(args)
    out_dir = Path(args.out)
    with distributed(args.device) as (rank, world, device):
        env = collect_env(args, device, world)
        env["deepep_setup"] = deepep_setup
        # DBO_DISABLE makes every plan unsplit: the DBO rows then time the plain forward
        env["dbo_disabled"] = dbo_disabled_by_env()
        with torch.inference_mode():
            bundle = run(args, rank, world, device, out_dir, env)
        ok, why = judge(bundle, out_dir)
        if rank == 0:
            print(format_table(bundle), flush=True)
            verdict(PROG, ok, why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
