"""Captures of one shape: dbo's schedule trace and torch.profiler kernel traces of a step, and
a whole serial, DBO, merged and sbo step captured into CUDA graphs and replayed (deepep_ll,
copy_engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dbo
from dbo.backends import BACKENDS
from dbo.bench.overlap.shape import ShapeBench, max_rel_error
from dbo.bench.timeline import timeline_svg
from dbo.bench.timing import measure
from dbo.files import whole_file, write_whole
from dbo.peers.collectives import all_reduce_max

__all__ = ["traces", "cuda_graph", "GRAPH_BACKENDS"]

#: the backends whose whole step a CUDA graph can hold: no host wait on the GPU inside a step
#: (deepep_ht's dispatch reads its receive counts on the host)
GRAPH_BACKENDS = tuple(name for name, spec in BACKENDS.items() if spec.graph_capturable)


def traces(sb: ShapeBench, profile: bool, out_dir: Path) -> dict | None:
    """One DBO step recorded by dbo.Trace (returned as Chrome JSON); on the profiled shape
    torch.profiler kernel traces of the best DBO and serial steps (and of the merged and sbo
    steps where ``--modes`` has them), each drawn as an SVG timeline of its streams
    (:mod:`dbo.bench.timeline`: ``timeline_<mode>.svg``)."""
    sb.use_best("dbo")
    trace = dbo.Trace()
    sb.dbo(trace=trace)
    files = {}
    if profile and sb.device.type == "cuda":
        extra = [m for m in ("merged", "sbo", "sbo_dbo") if m in sb.opts.modes]
        for mode in ("dbo", "serial", *extra):
            sb.use_best(mode)
            fn = sb.step(mode)
            fn()
            torch.cuda.synchronize()
            files.update(_profiled(sb, fn, out_dir, mode, f"{sb.label(mode)}, {sb.opts.backend}"))
    sb.rec.trace_files = files
    sb.progress.update(sb.label("traces"))
    return trace.to_chrome() if sb.rank == 0 else None

def _profiled(sb: ShapeBench, fn: Any, out_dir: Path, name: str, title: str) -> dict[str, str]:
    """Run ``fn`` once on every rank (its collectives must match), under torch.profiler on rank 0:
    its kernel trace ``gpu_trace_<name>.json`` and timeline ``timeline_<name>.svg`` in
    ``out_dir``; returns the files written, by key. A profile is a bonus: a failure is a warning."""
    files: dict[str, str] = {}
    prof = None
    if sb.rank == 0:
        try:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - a profile is a bonus, never fatal
            prof = None
            sb.rec.warnings.append(f"torch.profiler failed: {type(exc).__name__}: {exc}")
    fn()
    torch.cuda.synchronize()
    if prof is not None:
        try:
            prof.__exit__(None, None, None)
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"gpu_trace_{name}.json"
            with whole_file(path) as tmp:
                prof.export_chrome_trace(str(tmp))
            files[f"gpu_trace_{name}"] = path.name
            svg = out_dir / f"timeline_{name}.svg"
            write_whole(svg, timeline_svg(json.loads(path.read_text()), title=title))
            files[f"timeline_{name}"] = svg.name
        except Exception as exc:  # noqa: BLE001
            sb.rec.warnings.append(f"torch.profiler failed: {type(exc).__name__}: {exc}")
    return files


def _capture(sb: ShapeBench, mode: str, res: dict[str, Any], graphs: list[Any],
             profile_dir: Path | None = None) -> torch.Tensor:
    """Time ``mode``'s eager step, capture it whole, replay it: its figures into ``res``."""
    if mode in sb.alone:  # "compute", "comm"
        fn = sb.alone[mode]()
    else:
        sb.use_best(mode)
        fn = sb.step(mode)
    eager = fn()
    res[f"eager_{mode}_ms"] = measure(fn, warmup=1, steps=sb.opts.steps, device=sb.device,
                                      memory=False).median_ms / sb.layers
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        static_out = fn()
    graphs.append(g)
    g.replay()
    torch.cuda.synchronize()
    res[f"{mode}_replay_rel_err"] = max_rel_error(static_out, eager, sb.device)
    res[f"{mode}_replay_bitwise_equal"] = bool(
        all_reduce_max([0.0 if torch.equal(static_out, eager) else 1.0])[0] == 0.0)
    timing = measure(g.replay, warmup=2, steps=sb.opts.steps, device=sb.device)
    res[f"graph_{mode}_ms"] = timing.median_ms / sb.layers
    res[f"graph_{mode}_timing"] = timing.to_json()
    if profile_dir is not None and mode in ("serial", "dbo"):  # the replayed step's kernels, by stream
        files = _profiled(sb, g.replay, profile_dir, f"graph_{mode}",
                          f"{mode} replayed from a CUDA graph, {sb.opts.backend}")
        sb.rec.trace_files = {**(sb.rec.trace_files or {}), **files}
    if res[f"{mode}_replay_rel_err"] > sb.tol:
        sb.rec.warnings.append(f"T={sb.T}: the replayed {mode} graph differs from "
                                  f"eager (rel err {res[f'{mode}_replay_rel_err']:.3e})")
    return static_out


def _clean_after_failed_capture(sb: ShapeBench, res: dict[str, Any], key: str) -> None:
    try:
        torch.cuda.synchronize()
        # an aborted capture advanced DeepEP's host-side buffer index without running the
        # kernels: clean both low-latency buffers (collective; the failure is symmetric)
        pf = sb.pf
        if hasattr(pf, "buffer") and hasattr(pf.buffer, "clean_low_latency_buffer"):
            pf.buffer.clean_low_latency_buffer(pf.max_tokens_per_rank, pf.padded_hidden,
                                               pf.num_experts)
            torch.cuda.synchronize()
    except Exception as exc2:  # noqa: BLE001 - a sticky CUDA error: nothing more can run
        res[key] += f"; then {type(exc2).__name__}: {exc2}"
        raise


def graph_bound(res: dict[str, Any]) -> None:
    """The replayed schedules against the bound, into ``res``: ``graph_best_ms`` (the fastest
    overlapped schedule replayed) and, where the compute and the comm alone were replayed,
    ``graph_bound_speedup`` (serial / max(compute, comm)), ``graph_best_speedup`` (serial /
    best) and ``graph_efficiency`` ((serial - best) / min(compute, comm): the share of the
    hideable time hidden)."""
    tried = {m: res[f"graph_{m}_ms"] for m in ("dbo", "merged", "sbo", "sbo_dbo") if f"graph_{m}_ms" in res}
    best = min(tried, key=tried.get)
    res["graph_best"], res["graph_best_ms"] = best, tried[best]
    serial = res["graph_serial_ms"]
    res["graph_best_speedup"] = serial / tried[best]
    c, x = res.get("graph_compute_ms"), res.get("graph_comm_ms")
    if c and x:
        res["graph_bound_speedup"] = serial / max(c, x)
        res["graph_efficiency"] = (serial - tried[best]) / min(c, x)


def cuda_graph(sb: ShapeBench, profile_dir: Path | None = None) -> None:
    """Capture a whole serial, DBO (split), merged-schedule and sbo step; replay; compare with
    eager. The merged and sbo captures are optional (``--modes``): where one fails, the serial
    and DBO figures stand. ``profile_dir``: profile one replay of the serial and the DBO step
    there (``gpu_trace_graph_serial.json``, ``gpu_trace_graph_dbo.json``: the kernels of the
    step as the GPU ran them, with no host in the way; ``python -m dbo.bench breakdown`` reads
    them)."""
    res: dict[str, Any] = {"ok": False}
    sb.rec.cuda_graph = res
    if sb.budget.expired():
        res["error"] = "skipped: time budget"
        sb.progress.update(sb.label("cuda graph") + " (skipped)")
        return
    graphs: list[Any] = []
    try:
        try:
            outs = {mode: _capture(sb, mode, res, graphs, profile_dir) for mode in ("serial", "dbo")}
            res["dbo_vs_serial_rel_err"] = max_rel_error(outs["dbo"], outs["serial"], sb.device)
            res["dbo_replay_equals_eager"] = res["dbo_replay_rel_err"] <= sb.tol
            res["graph_dbo_over_serial"] = res["graph_dbo_ms"] / res["graph_serial_ms"]
            res["graph_serial_over_dbo"] = res["graph_serial_ms"] / res["graph_dbo_ms"]
            res["eager_dbo_over_graph_dbo"] = res["eager_dbo_ms"] / res["graph_dbo_ms"]
            res["ok"] = True
        except Exception as exc:  # noqa: BLE001 - report what prevented capture, keep the bundle
            res["error"] = f"{type(exc).__name__}: {exc}"
            sb.rec.warnings.append(f"T={sb.T}: CUDA graph capture/replay failed: {res['error']}")
            _clean_after_failed_capture(sb, res, "error")
        # the other schedules, and the compute and the comm alone (the bound), where asked for and
        # time allows
        for extra in ("merged", "sbo", "sbo_dbo", "compute", "comm"):
            if not res["ok"] or extra not in sb.opts.modes or sb.budget.expired():
                continue
            if extra in ("compute", "comm") and extra not in sb.alone:
                continue
            try:
                out = _capture(sb, extra, res, graphs)
                res[f"graph_{extra}_over_serial"] = res[f"graph_{extra}_ms"] / res["graph_serial_ms"]
                if extra in ("sbo", "sbo_dbo"):
                    res[f"{extra}_vs_serial_rel_err"] = max_rel_error(out, outs["serial"], sb.device)
            except Exception as exc:  # noqa: BLE001 - these figures are extra
                res[f"{extra}_error"] = f"{type(exc).__name__}: {exc}"
                sb.rec.warnings.append(f"T={sb.T}: {extra} CUDA graph failed: {res[extra + '_error']}")
                _clean_after_failed_capture(sb, res, f"{extra}_error")
        if res["ok"]:
            graph_bound(res)
    finally:
        graphs.clear()
        sb.pf.reset()
        sb.pf_dbo.reset()
    sb.progress.update(sb.label("cuda graph"))
