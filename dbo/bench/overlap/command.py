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
min(compute, comm) (:mod:`dbo.bench.overlap.summary` has the exact definitions). With ``--cuda-graph``
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

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.backends import BACKENDS, make_backend
from dbo.bench.cli import verdict
from dbo.bench.dist import distributed
from dbo.bench.limits import layer_limit_ms, measure_device_limits
from dbo.bench.overlap.args import PROG, collect_env, configure_deepep, parse_args
from dbo.bench.overlap.capture import GRAPH_BACKENDS, cuda_graph, traces
from dbo.bench.overlap.link import measure_link
from dbo.bench.overlap.model import BenchModel, LayerDims
from dbo.bench.overlap.options import OverlapOptions
from dbo.bench.overlap.record import OverlapResult, ShapeRecord
from dbo.bench.overlap.report import format_table, write_plot
from dbo.bench.overlap.shape import Budget, ShapeBench
from dbo.bench.overlap.summary import summarize
from dbo.bench.overlap.wrapper import time_wrapper, tune_and_time_wrapper
from dbo.bench.timing import Progress
from dbo.cli import refuse, run_main
from dbo.deployment import DeploymentConfig, save_deployment_config
from dbo.expert_schedule import ExpertSchedule
from dbo.files import write_whole
from dbo.split import DISABLE_ENV_VAR, NEVER_SPLIT, SplitConfig, Vote, dbo_disabled_by_env, local_vote
from dbo.ubatch.sm import sm_carveout, torch_sm_carveout_supported

__all__ = ["run", "main"]


def build_backend(opts: OverlapOptions, tokens: int, device: torch.device, dtype: torch.dtype) -> Any:
    """The run's backend with room for ``tokens`` tokens per rank."""
    return make_backend(opts.backend, None, hidden=opts.hidden, num_experts=opts.experts,
                        topk=opts.topk, max_tokens_per_rank=tokens, dtype=dtype, device=device,
                        link=opts.link_model, **opts.backend_kwargs)


def _write(result: OverlapResult, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_whole(out_dir / "bench_overlap.json", json.dumps(result.to_json(), indent=1, default=str))


def run(opts: OverlapOptions, rank: int, world: int, device: torch.device, out_dir: Path,
        env: dict) -> OverlapResult:
    """Measure every shape of ``opts``' grid on this rank of a ``world``-rank group (collective);
    rank 0 writes the bundle to ``out_dir``. ``env``: the environment record, completed here
    with the limits and links measured."""
    dtype = opts.torch_dtype
    ep_rank, ep_world = opts.ep_group(rank, world)
    budget = Budget(opts.time_budget_s, device)
    result = OverlapResult(opts, env, partial=True)
    if opts.sm_carveout is not None and not torch_sm_carveout_supported():  # main() sets it
        result.warnings.append("--sm-carveout: this torch has no _set_sm_carveout_experimental")
    # one backend for every shape, except deepep_ll whose capacity is the batch: the first one
    # built is the largest, so the shared DeepEP buffer is sized once
    shared_backend = build_backend(opts, max(opts.tokens), device, dtype)
    # the ceilings for the compute columns' limit, measured on this device in this run
    limits = measure_device_limits(device)
    env["limits"] = limits.as_dict()
    # the link rate for the comm column's limit, measured on this group in this run
    link = measure_link(None, device)
    env["link"] = None if link is None else link.as_dict()
    if link is not None and rank == 0:
        print(link.describe(), flush=True)
    sim = opts.link_model
    env["simulated_link"] = None if sim is None else sim.as_dict()
    if sim is not None and opts.emulate_ep:
        # an emulated rank counts the remote bytes itself: from the hosts, or --remote-fraction
        env["simulated_link"]["remote_fraction"] = (
            opts.remote_fraction if opts.remote_fraction is not None
            else 1.0 - min(opts.gpus_per_host, opts.emulate_ep) / opts.emulate_ep)
    if sim is not None and rank == 0:
        print(sim.describe(), flush=True)
    # the bar starts once the lines above are out: nothing else prints until it closes
    progress = Progress(opts.config_count(), enabled=rank == 0)
    target = opts.profiled_shape()
    chrome = []
    configs: dict[int, SplitConfig | None] = {}
    # The split decision's all-reduce over NCCL would read its result back on the host, i.e.
    # wait for the GPU every step: decide over a CPU (gloo) group instead, as an engine would.
    decision_group = dist.new_group(backend="gloo") if opts.autotune and device.type == "cuda" else None
    try:
        for inter in opts.intermediate:
            dims = LayerDims(hidden=opts.hidden, intermediate=inter,
                             shared_intermediate=opts.shared_intermediate or inter,
                             num_experts=opts.experts, topk=opts.topk, attn_width=opts.attn_width,
                             layers=opts.layers, dtype=dtype, attn_yield=opts.attn_yield)
            model = BenchModel(dims, ep_rank, ep_world, device, seed=opts.seed)
            benches: list[ShapeBench] = []
            for tokens in opts.tokens:
                backend = shared_backend
                if opts.decode and tokens != max(opts.tokens):
                    backend = build_backend(opts, tokens, device, dtype)
                dbo_backend = None
                if opts.decode:
                    dbo_backend = build_backend(opts, -(-tokens // 2), device, dtype)
                sb = ShapeBench(opts, model, backend, tokens, device, rank, progress, budget,
                                dbo_backend)
                sb.rec.flops_per_token_per_layer = dims.flops_per_token()
                sb.link = link
                sb.rec.limit_ms_per_layer = layer_limit_ms(
                    limits, tokens=tokens, hidden=dims.hidden, intermediate=inter,
                    shared_intermediate=dims.shared_intermediate, num_experts=dims.num_experts,
                    topk=dims.topk, attn_width=dims.attn_width, world_size=ep_world,
                    dtype_bytes=torch.empty((), dtype=dtype).element_size())
                if not budget.expired():
                    sb.reference()
                    sb.compute_alone()
                    sb.comm_alone()
                    sb.serial_and_dbo()
                    profiled = target == (tokens, inter)
                    trace = traces(sb, profiled, out_dir)
                    if trace is not None:
                        chrome.append((f"{opts.backend} T={tokens} I={inter}", trace))
                    if opts.autotune:  # the untuned wrapper: the default config, adaptive
                        time_wrapper(sb, SplitConfig(), decision_group, mode="wrapper_untuned")
                    if opts.cuda_graph:
                        if device.type == "cuda" and opts.layout in GRAPH_BACKENDS:
                            cuda_graph(sb, out_dir if profiled else None)
                        else:
                            sb.rec.cuda_graph = {"ok": False, "error": "--cuda-graph needs "
                                                 f"--device cuda and a backend of {GRAPH_BACKENDS}"}
                            progress.update("cuda graph (n/a)")
                    sb.drop_alone()
                else:
                    sb.rec.skipped = "time budget"
                backend.reset()
                sb.pf_dbo.reset()
                splits = local_vote(tokens, SplitConfig(), decode_only=opts.decode).vote is Vote.YES
                sb.rec.summary = summarize(sb.rec, splits)
                result.shapes.append(sb.rec)
                benches.append(sb)
                if rank == 0:  # what is done so far survives a later crash or kill
                    _write(result, out_dir)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if opts.autotune:
                result.autotune[inter], configs[inter] = tune_and_time_wrapper(
                    opts, benches, budget, progress, decision_group)
            del model, benches
    finally:
        progress.close()
    result.partial = False
    if budget.hit:
        result.warnings.append(f"time budget of {opts.time_budget_s:.0f} s reached: some configurations "
                               "were skipped (see 'skipped' in the JSON)")
    if opts.save_config and rank == 0:
        save_tuned(opts, env, configs.get(opts.intermediate[0]), result.warnings, ep_world, result.shapes)
    finish(result, chrome, out_dir, rank)
    return result


def wins_from(vals: list[tuple[int, float | None]], wins: Callable[[float], bool]) -> int | None:
    """The smallest token count of ``vals`` (``(tokens, speedup)``, ascending) from which every
    larger count's speedup ``wins``; None where the largest does not (or was not measured)."""
    start = None
    for t, v in reversed(vals):
        if v is None or not wins(v):
            break
        start = t
    return start


def graph_decode_choice(shapes: list[ShapeRecord], margin: float = 0.02
                        ) -> tuple[int, ExpertSchedule, dict[int, float]] | None:
    """The decode steps' choice from their CUDA-graph replays (the regime a decode step runs in;
    eager decode steps are the host's pace): the smallest token count from which the fastest
    splitting schedule replayed (split, merged, sbo+dbo) beats the replayed serial step by
    ``margin`` at every larger count measured (:data:`NEVER_SPLIT` where none), that schedule at
    the threshold, and each count's speedup; None without replays."""
    best: dict[int, tuple[str, float]] = {}
    for sh in shapes:
        g = sh.cuda_graph or {}
        tried = {m: g[f"graph_{m}_ms"] for m in ("dbo", "merged", "sbo_dbo") if g.get(f"graph_{m}_ms")}
        if g.get("ok") and tried:
            mode = min(tried, key=tried.get)
            best[sh.tokens] = (mode, g["graph_serial_ms"] / tried[mode])
    if not best:
        return None
    threshold = wins_from(sorted((t, v) for t, (_, v) in best.items()), lambda v: v >= 1 + margin)
    threshold = NEVER_SPLIT if threshold is None else threshold
    schedules = {"dbo": ExpertSchedule.SPLIT, "merged": ExpertSchedule.MERGED,
                 "sbo_dbo": ExpertSchedule.SBO_DBO}
    schedule = schedules[best[threshold][0]] if threshold in best else ExpertSchedule.SPLIT
    return threshold, schedule, {t: v for t, (_, v) in sorted(best.items())}


def save_tuned(opts: OverlapOptions, env: dict, config: SplitConfig | None, warnings: list[str],
               ep_world: int, shapes: list[ShapeRecord] = ()) -> None:
    """``--save-config``: the autotune's ``config`` of the run's one intermediate size, with
    the deployment it was tuned for (:mod:`dbo.deployment`). A decode run with ``--cuda-graph``
    takes its decode threshold and schedule from the replays (:func:`graph_decode_choice`): the
    autotune times eager steps, which at decode sizes are the host's pace, not the GPU's."""
    graph = graph_decode_choice(list(shapes)) if opts.cuda_graph and opts.decode else None
    if graph is not None:
        threshold, schedule, speedups = graph
        config = dataclasses.replace(config or SplitConfig(), decode_token_threshold=threshold,
                                     expert_schedule=schedule)
    if config is None:
        warnings.append(f"--save-config {opts.save_config}: the autotune did not finish (time budget?); "
                        "nothing written")
        return
    carveouts = [c for c in opts.dbo_sm_carveout if c is not None]
    deployment = {"ep_size": ep_world, "emulated_rank": opts.emulate_rank if opts.emulate_ep else None,
                  "layout": opts.layout, "backend": opts.backend, "link": env.get("simulated_link"),
                  "device": env.get("device_name"), "tokens": list(opts.tokens),
                  "intermediate": opts.intermediate[0], "hidden": opts.hidden, "experts": opts.experts,
                  "topk": opts.topk, "argv": env.get("argv"), "time": env.get("time")}
    if graph is not None:
        deployment["decode_choice"] = {"from": "CUDA graph replays",
                                       "speedup_by_tokens": {str(t): v for t, v in speedups.items()}}
    save_deployment_config(opts.save_config, DeploymentConfig(
        config, sbo_groups=opts.sbo_groups, sm_carveout=carveouts[0] if len(carveouts) == 1 else None,
        deployment=deployment))
    print(f"wrote the tuned config to {opts.save_config} (DBOWrapper(model, "
          f"load_deployment_config({opts.save_config!r})))", flush=True)


def _crossovers(result: OverlapResult) -> list[dict]:
    out = []
    for inter in result.options.intermediate:
        rows = sorted((sh for sh in result.shapes if sh.intermediate == inter), key=lambda sh: sh.tokens)
        res: dict[str, Any] = {"intermediate": inter}
        for kind, get in (("eager", lambda sh: None if sh.summary is None else sh.summary.speedup),
                          ("graph", lambda sh: (sh.cuda_graph or {}).get("graph_serial_over_dbo"))):
            vals = [(sh.tokens, get(sh)) for sh in rows]
            if all(v is None for _, v in vals):
                continue
            res[kind] = wins_from(vals, lambda v: v > 1.0)
        out.append(res)
    return out


#: prefixes the notes of a CPU run: its speed targets are expected to be missed
CPU_NOTE = ("on CPU there is nothing to overlap (gloo runs on the cores that compute); the speed "
            "and efficiency targets apply to GPUs")


def _shape_warnings(sh: ShapeRecord) -> tuple[list[str], list[str]]:
    """A shape's warnings beyond its own, and its missed speed targets."""
    label = sh.label
    w: list[str] = []
    perf: list[str] = []
    for m in sh.measurements:
        t = m.timing
        if t and t.cpu_bound:
            w.append(f"{label} {m.mode} s{m.num_sms}: CPU launch time "
                     f"{t.cpu_launch_held_ms or t.cpu_launch_ms:.2f} ms is over 80% of the GPU "
                     f"time {t.median_ms:.2f} ms: Python, not the GPU, sets the pace")
    synced = sorted({m.mode for m in sh.measurements if m.timing and m.timing.host_sync})
    if synced:
        w.append(f"{label}: steps of {', '.join(synced)} wait for the GPU from the host (launch time "
                 "includes those waits; see cpu_launch_* in the JSON)")
    s = sh.summary
    if s is None:
        return w, perf
    if s.peak_ratio is not None and s.peak_ratio > 1.1:
        perf.append(f"{label}: DBO peak memory is {s.peak_ratio:.2f}x the serial peak (target <= 1.1)")
    if s.untuned_wrapper_vs_serial is not None and s.untuned_wrapper_vs_serial > 1.02:
        perf.append(f"{label}: the untuned (adaptive) wrapper is "
                    f"{100 * (s.untuned_wrapper_vs_serial - 1):.0f}% slower than serial (limit 2%)")
    if s.wrapper_vs_serial is not None and s.wrapper_vs_serial > 1.02:
        who = "the wrapper with the autotuned config" if s.wrapper_measured else "the default SplitConfig"
        perf.append(f"{label}: {who} is {100 * (s.wrapper_vs_serial - 1):.0f}% slower than "
                    "serial (limit 2%)")
    share, eff = s.comm_share, s.efficiency
    if share is not None and eff is not None and share >= 0.25 and eff < 0.6:
        perf.append(f"{label}: communication is {100 * share:.0f}% of the serial layer and the overlap "
                    f"efficiency is {eff:.2f} (target >= 0.6)")
    return w, perf


def finish(result: OverlapResult, chrome: list[tuple[str, dict]], out_dir: Path, rank: int) -> None:
    """Shape warnings, the crossover, the files and the table (rank 0 writes). On the CPU the
    missed speed targets go to ``result.notes``, after :data:`CPU_NOTE`, not to the warnings."""
    w = result.warnings
    perf: list[str] = []  # speed targets missed: warnings on GPUs, notes on the CPU
    for sh in result.shapes:
        w.extend(sh.warnings)
        more, missed = _shape_warnings(sh)
        w.extend(more)
        perf.extend(missed)
    if result.dbo_disabled:  # targets of DBO, which did not run
        perf = [f"{DISABLE_ENV_VAR}=1: DBO was disabled; the speed targets were not checked"]
    if result.options.device == "cpu":
        result.notes = [CPU_NOTE, *perf] if perf else []
    else:
        w.extend(perf)
    result.crossover = _crossovers(result) if result.options.decode else None
    if rank != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    files = result.files
    if chrome:
        events: list[dict] = []
        for pid, (name, tr) in enumerate(chrome):
            for e in tr["traceEvents"]:
                e = dict(e, pid=pid)
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"{name} (one DBO step, rank 0)"}
                events.append(e)
        path = out_dir / "bench_overlap.trace.json"
        write_whole(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
        files["trace"] = path.name
    for sh in result.shapes:
        files.update(sh.trace_files)
    plot = write_plot(result, str(out_dir / "bench_overlap.png"))
    # matplotlib is optional: without it the bundle has no PNG, which is no fault of the run
    files["plot"] = Path(plot).name if plot else None
    files["json"] = "bench_overlap.json"
    _write(result, out_dir)


def mismatches(result: OverlapResult) -> list[str]:
    """The checks whose output differed from the serial reference by more than the tolerance
    (``"T=64 I=64 dbo_sNone: 3.1e-02"``); empty when every output matched."""
    tol = result.options.tolerance
    bad = []
    for sh in result.shapes:
        bad.extend(f"{sh.label} {name}: {err.token_median:.1e}"
                   for name, err in sh.checks.items() if not err.ok(tol))
        g = sh.cuda_graph or {}
        if g.get("ok"):
            bad.extend(f"{sh.label} {name}: {g[name]:.1e}" for name in ("dbo_replay_rel_err",
                                                                         "serial_replay_rel_err")
                       if not g[name] <= tol)
    return bad


def judge(result: OverlapResult, out_dir: Path) -> tuple[bool, str]:
    """The run's verdict: ``(passed, why)``, ``why`` naming the folder the bundle is in."""
    tol = result.options.tolerance
    where = f"bundle in {out_dir}{'' if str(out_dir).endswith('/') else '/'}"
    bad = mismatches(result)
    if bad:
        return False, (f"{len(bad)} output(s) differ from serial by more than {tol:g} "
                       f"({'; '.join(bad[:3])}); {where}")
    checked = sum(len(sh.checks) for sh in result.shapes)
    if not checked:
        return False, f"no output was checked (every shape was skipped); {where}"
    if result.dbo_disabled:
        return True, (f"{DISABLE_ENV_VAR}=1: DBO was disabled, every DBO row ran the plain forward; "
                      f"{checked} outputs over {len(result.shapes)} shape(s) match the serial "
                      f"reference within {tol:g}; {where}")
    return True, (f"{checked} serial and DBO outputs over {len(result.shapes)} shape(s) match "
                  f"the serial reference within {tol:g}; {where}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if BACKENDS[opts.backend].uses_deep_ep:
        from dbo.backends.deepep.buffer import DeepEPNotInstalledError, import_deep_ep

        if opts.fake_deep_ep:
            from dbo.testing.fake_deep_ep import ensure_fake_deep_ep
            ensure_fake_deep_ep("v1")
        try:  # before the group: every rank stops here alike
            import_deep_ep()
        except DeepEPNotInstalledError as exc:
            refuse(PROG, f"--backend {opts.backend}: {exc}")
    deepep_setup = configure_deepep(opts.backend, opts.tokens, opts.num_sms)
    out_dir = Path(opts.out)
    with distributed(opts.device) as (rank, world, device):
        env = collect_env(device, world, backend=opts.backend, out=opts.out)
        env["deepep_setup"] = deepep_setup
        # DBO_DISABLE makes every plan unsplit: the DBO rows then time the plain forward
        env["dbo_disabled"] = dbo_disabled_by_env()
        # --sm-carveout for the whole run (torch's and the experts'); a DBO run's own replaces it
        carve = opts.sm_carveout if torch_sm_carveout_supported() else None
        with torch.inference_mode(), sm_carveout(carve):
            result = run(opts, rank, world, device, out_dir, env)
        ok, why = judge(result, out_dir)
        if rank == 0:
            print(format_table(result), flush=True)
            verdict(PROG, ok, why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
