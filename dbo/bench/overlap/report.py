"""The text table and the plot of the overlap benchmark (``dbo.bench overlap``), read from the
run's record (:mod:`dbo.bench.overlap.record`); the figures are defined in
:mod:`dbo.bench.overlap.summary`."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from dbo.bench.cli import legend
from dbo.bench.limits import rate_text
from dbo.bench.overlap.record import OverlapResult
from dbo.files import whole_file

__all__ = ["PLOT_HINT", "format_table", "write_plot"]


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _link(env: dict) -> str:
    sim = env.get("simulated_link")
    if not sim:
        return ""
    fixed = f"{sim['latency_us']:g}us" if sim.get("combine_latency_us") is None else \
        f"{sim['latency_us']:g}/{sim['combine_latency_us']:g}us"
    name = f"{sim['name']}=" if sim.get("name") else ""
    return (f" link={name}{sim['gbps']:g}GB/s,{fixed},{sim.get('order', 'host')},"
            f"remote={sim['remote_fraction']:.3f}")


#: what the bundle says in place of the plot where matplotlib is missing
PLOT_HINT = ("matplotlib is not installed: pip install matplotlib, or pip install -e '.[bench]' in "
             "the clone, draws it")

#: the columns of the main table, as the line under it explains them
MAIN_COLUMNS = {
    "tokens": "tokens per rank", "I": "each expert's intermediate size",
    "compute": "the layer's compute alone (communication replayed)",
    "comm": "its all-to-all alone (dispatch and combine)", "x link": "comm / the link limit (below)",
    "comm%": "comm / serial, in %", "serial": "the fastest serial run", "dbo": "the fastest DBO run "
    "(split schedule)", "[cfg]": "the run's config (sN DeepEP SMs, kN DBO SM carve-out)",
    "speedup": "serial / dbo", "eff": "(serial - dbo) / min(compute, comm): the share of the "
    "hideable time hidden (1 perfect, 0 none)", "dbo-cmp": "DBO's compute alone",
    "peak": "peak memory of the best DBO run / of the best serial (weights included)",
    "peak+": "the same for the memory allocated during the step only",
    "wrap": "DBOWrapper with the autotuned config / serial, timed alternately",
    "untun": "DBOWrapper with the default adaptive config / serial",
    "merged": "the fastest DBO run with the merged schedule (one experts call per layer)",
    "m-cmp": "merged's compute alone", "sbo": "the unsplit schedule, shared experts beside the "
    "dispatch", "best": "the fastest of plain (serial), split (dbo), merged"}
SMS_COLUMNS = {"sms": "DeepEP's SM count", "comm": "comm alone at that count",
               "serial, dbo": "the fastest at that count", "speedup, eff": "as above, against the "
               "best serial overall"}
GRAPH_COLUMNS = {"eager-s, eager-d": "serial and DBO step without a graph",
                 "graph-s, graph-d, graph-m, graph-b, g-sd": "serial, DBO, merged, sbo, sbo+dbo "
                 "replayed from a CUDA graph", "d/s, m/s, b/s": "graph-d, graph-m, graph-b / graph-s",
                 "equal": "the DBO replay's output equals the eager DBO step's",
                 "g-cmp, g-comm": "the compute alone and the comm alone, replayed",
                 "best": "graph-s / the fastest overlapped replay (a speedup)",
                 "bound": "graph-s / max(g-cmp, g-comm): the most overlap could give",
                 "eff": "(graph-s - fastest) / min(g-cmp, g-comm): the share of the hideable time hidden"}
LIMIT_COLUMNS = {"limit": "the compute's hardware limit (above)", "x lim": "compute / limit",
                 "dbo-cmp, m-cmp": "split and merged DBO's compute alone",
                 "x-cmp": "dbo-cmp / compute", "m/cmp": "m-cmp / compute"}
LINK_COLUMNS = {"MB out": "the bytes a rank sends per layer", "link": "MB out at the measured rate",
                "x link": "comm / link"}


def format_table(result: OverlapResult | Mapping[str, Any]) -> str:
    """The short text table printed at the end (per-layer milliseconds), of a run's record or
    of its bundle's JSON."""
    if not isinstance(result, OverlapResult):
        result = OverlapResult.from_json(result)
    env, o = result.env, result.options
    shapes = [(sh, sh.summary) for sh in result.shapes if sh.summary is not None]
    where = f"world={env.get('world_size')}"
    if o.emulate_ep:
        where = (f"emulated rank {o.emulate_rank} of EP{o.emulate_ep} "
                 f"({o.emulate_layout} layout, {o.gpus_per_host} GPUs a host; not modelled: "
                 "incast, congestion, stragglers, routing skew, DeepEP's SMs)")
    lines = [f"dbo bench_overlap: backend={o.backend} {where} "
             f"device={env.get('device_name')} layers/step={o.layers} hidden={o.hidden} "
             f"experts={o.experts} top-{o.topk} attn_width={o.attn_width}{_link(env)}",
             f"times per layer in ms: median of {o.steps} steps (step time = slowest rank); "
             "cfg sN = DeepEP SMs, kN = DBO SM carve-out; dbo = split schedule, merged = one "
             "experts call per layer (m-cmp: its compute alone), sbo = unsplit, shared experts "
             "beside the dispatch, a combine per expert group"]
    off = result.dbo_disabled
    if off:
        lines.append("DBO_DISABLE=1: DBO was disabled in this run; every plan was unsplit, so the "
                     "DBO columns (dbo, dbo-cmp, wrap, untun, merged, m-cmp) timed the plain forward "
                     "and their speedups read 'off'")
    head = (f"{'tokens':>6} {'I':>5} {'compute':>8} {'comm':>7} {'x link':>6} {'comm%':>5} {'serial':>7} "
            f"{'[cfg]':>8} "
            f"{'dbo':>7} {'[cfg]':>8} {'speedup':>7} {'eff':>5} {'dbo-cmp':>7} {'peak':>5} {'peak+':>5} "
            f"{'wrap':>5} {'untun':>5} {'merged':>7} {'m-cmp':>7} {'sbo':>7} {'best':>6}")
    lines.append(head)
    for sh, s in shapes:
        share = s.comm_share
        lines.append(
            f"{sh.tokens:>6} {sh.intermediate:>5} {_f(s.compute_ms):>8} "
            f"{_f(s.comm_ms):>7} {_f(s.comm_x_link):>6} "
            f"{_f(None if share is None else 100 * share, '.0f'):>5} "
            f"{_f(s.serial_ms):>7} {s.serial_config:>8} {_f(s.dbo_ms):>7} "
            f"{s.dbo_config:>8} {'off' if off else _f(s.speedup, '.3f'):>7} "
            f"{'off' if off else _f(s.efficiency):>5} {_f(s.dbo_compute_ms):>7} "
            f"{_f(s.peak_ratio):>5} {_f(s.peak_extra_ratio):>5} "
            f"{_f(s.wrapper_vs_serial, '.3f'):>5} {_f(s.untuned_wrapper_vs_serial, '.3f'):>5} "
            f"{_f(s.merged_ms):>7} "
            f"{_f(s.merged_compute_ms):>7} {_f(s.sbo_ms):>7} "
            f"{'off' if off else s.best_schedule or '-':>6}")
    lines.extend(legend(MAIN_COLUMNS))
    if any(s.per_num_sms for _, s in shapes):
        lines.append("DeepEP SM count (Buffer.set_num_sms): comm alone, best serial/DBO at that count, "
                     "speedup and efficiency against the best serial overall")
        lines.append(f"{'tokens':>6} {'I':>5} {'sms':>4} {'comm':>7} {'serial':>7} {'dbo':>7} {'[cfg]':>8} "
                     f"{'speedup':>7} {'eff':>5}")
        for sh, s in shapes:
            for r in s.per_num_sms:
                lines.append(f"{sh.tokens:>6} {sh.intermediate:>5} {r.num_sms:>4} "
                             f"{_f(r.comm_ms):>7} {_f(r.serial_ms):>7} {_f(r.dbo_ms):>7} "
                             f"{r.dbo_config:>8} {'off' if off else _f(r.speedup, '.3f'):>7} "
                             f"{'off' if off else _f(r.efficiency):>5}")
        lines.extend(legend(SMS_COLUMNS))
    graphs = [sh for sh in result.shapes if sh.cuda_graph]
    if graphs:
        lines.append("CUDA graph (whole step captured; per layer ms): eager serial/DBO, replayed "
                     "serial/DBO, DBO replay == eager DBO, replayed merged, sbo and sbo+dbo schedules, "
                     "their ratios to serial, and the bound from the compute and comm replayed alone")
        lines.append(f"{'tokens':>6} {'I':>5} {'eager-s':>7} {'eager-d':>7} {'graph-s':>7} {'graph-d':>7} "
                     f"{'d/s':>6} {'equal':>6} {'graph-m':>7} {'m/s':>6} {'graph-b':>7} {'b/s':>6} "
                     f"{'g-sd':>6} {'g-cmp':>6} {'g-comm':>6} {'best':>6} {'bound':>6} {'eff':>5}")
        for sh in graphs:
            g = sh.cuda_graph
            if not g.get("ok"):
                lines.append(f"{sh.tokens:>6} {sh.intermediate:>5} FAILED: {g.get('error', '?')[:90]}")
                continue
            lines.append(f"{sh.tokens:>6} {sh.intermediate:>5} {_f(g['eager_serial_ms']):>7} "
                         f"{_f(g['eager_dbo_ms']):>7} {_f(g['graph_serial_ms']):>7} "
                         f"{_f(g['graph_dbo_ms']):>7} {_f(g['graph_dbo_over_serial'], '.3f'):>6} "
                         f"{str(g['dbo_replay_equals_eager']):>6} {_f(g.get('graph_merged_ms')):>7} "
                         f"{_f(g.get('graph_merged_over_serial'), '.3f'):>6} {_f(g.get('graph_sbo_ms')):>7} "
                         f"{_f(g.get('graph_sbo_over_serial'), '.3f'):>6} {_f(g.get('graph_sbo_dbo_ms')):>6} "
                         f"{_f(g.get('graph_compute_ms')):>6} {_f(g.get('graph_comm_ms')):>6} "
                         f"{_f(g.get('graph_best_speedup'), '.3f'):>6} "
                         f"{_f(g.get('graph_bound_speedup'), '.3f'):>6} "
                         f"{_f(g.get('graph_efficiency')):>5}")
        lines.extend(legend(GRAPH_COLUMNS))
    if any(s.limit_ms for _, s in shapes):
        lim = env.get("limits") or {}
        lines.append(f"compute against the limit (per layer; limit = sum over the layer's parts of "
                     f"max(bytes / {rate_text(lim.get('copy_gbps', 0) * 1e9, 'B/s')}, flops / "
                     f"{rate_text(lim.get('gemm_tflops', 0) * 1e12, 'FLOP/s')}), measured in this run; "
                     "x-cmp = split DBO compute / compute, m/cmp = merged DBO compute / compute)")
        lines.append(f"{'tokens':>6} {'I':>5} {'compute':>8} {'limit':>7} {'x lim':>6} {'dbo-cmp':>7} "
                     f"{'x-cmp':>6} {'m-cmp':>7} {'m/cmp':>6}")
        for sh, s in shapes:
            lines.append(f"{sh.tokens:>6} {sh.intermediate:>5} {_f(s.compute_ms):>8} "
                         f"{_f(s.limit_ms):>7} {_f(s.compute_x_limit):>6} "
                         f"{_f(s.dbo_compute_ms):>7} "
                         f"{_f(s.dbo_compute_over_compute, '.3f'):>6} "
                         f"{_f(s.merged_compute_ms):>7} "
                         f"{_f(s.merged_compute_over_compute, '.3f'):>6}")
        lines.extend(legend(LIMIT_COLUMNS))
    link = env.get("link")
    if link and any(s.link_ms for _, s in shapes):
        lines.append(f"comm against the link (per layer; link = bytes out of a rank / "
                     f"{rate_text(link['gbps_out'] * 1e9, 'B/s')}, {link['transport']}, measured in this "
                     "run)")
        lines.append(f"{'tokens':>6} {'I':>5} {'comm':>7} {'MB out':>7} {'link':>7} {'x link':>6}")
        for sh, s in shapes:
            mb = s.comm_bytes
            lines.append(f"{sh.tokens:>6} {sh.intermediate:>5} {_f(s.comm_ms):>7} "
                         f"{_f(None if mb is None else mb / 1e6, '.1f'):>7} {_f(s.link_ms):>7} "
                         f"{_f(s.comm_x_link):>6}")
        lines.extend(legend(LINK_COLUMNS))
    for cross in [] if off else result.crossover or []:
        lines.append(f"I={cross['intermediate']}: DBO faster than serial from "
                     f"{cross.get('eager', '-')} tokens/rank on (eager), {cross.get('graph', '-')} "
                     "(CUDA graph); None: at no size of the grid")
    for inter, tuned in result.autotune.items():
        if not tuned.ok:
            lines.append(f"I={inter}: autotune {tuned.error or 'failed'}")
            continue
        lines.append(f"I={inter}: dbo.autotune (per step, both ranks' slowest; 'wrap' above is the "
                     "wrapper measured with this config"
                     + ("; DBO_DISABLE=1: no DBO schedule could be timed" if off else "") + "):")
        lines.extend("  " + ln for ln in (tuned.table or "").splitlines())
    for w in result.warnings:
        lines.append(f"WARNING: {w}")
    notes = result.notes
    if notes:  # a CPU run's missed speed targets, under the line that says why they are expected
        lines.append(f"note: {notes[0]}:")
        lines.extend(f"  {n}" for n in notes[1:])
    files = result.files
    no_plot = f"; no PNG plot ({PLOT_HINT})" if "plot" in files and not files["plot"] else ""
    lines.append("bundle: " + ", ".join(f"{k}={v}" for k, v in files.items() if v) + no_plot)
    return "\n".join(lines)


def write_plot(result: OverlapResult, path: str) -> str | None:
    """Speedup and efficiency per shape as a PNG; None when matplotlib is missing (an optional
    dependency: the bundle's files then name no plot). matplotlib's own log is held to errors
    meanwhile: on a first import in a fresh home it logs warnings (building its font cache, an
    unwritable config directory) that are not about the run and, printed beside its verdict,
    read as a fault."""
    log = logging.getLogger("matplotlib")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        _draw(plt, result, path)
        return path
    finally:
        log.setLevel(level)


def _draw(plt: Any, result: OverlapResult, path: str) -> None:
    shapes = [(sh, sh.summary) for sh in result.shapes if sh.summary is not None]
    labels = [f"T={sh.tokens}\nI={sh.intermediate}" for sh, _ in shapes]
    x = list(range(len(shapes)))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(shapes) + 4), 4.5))
    ax = axes[0]
    ax.plot(x, [s.speedup or float("nan") for _, s in shapes], "o-", label="best DBO")
    sms = sorted({r.num_sms for _, s in shapes for r in s.per_num_sms})
    for n in sms:
        ys = [next((r.speedup for r in s.per_num_sms if r.num_sms == n), None) for _, s in shapes]
        ax.plot(x, [float("nan") if y is None else y for y in ys], ".--", label=f"DeepEP {n} SMs")
    if any((sh.cuda_graph or {}).get("ok") for sh, _ in shapes):
        ys = [(sh.cuda_graph or {}).get("graph_serial_over_dbo") for sh, _ in shapes]
        ax.plot(x, [float("nan") if y is None else y for y in ys], "s-", label="CUDA graph")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("speedup = serial / DBO" + (" (DBO_DISABLE=1: DBO was off)" if result.dbo_disabled else ""))
    ax.set_xticks(x, labels, fontsize=8)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(x, [s.efficiency or 0.0 for _, s in shapes], color="tab:green")
    ax.axhline(0.6, color="tab:red", lw=0.8, ls="--", label="target 0.6")
    ax.set_title("overlap efficiency = (serial - DBO) / min(compute, comm)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.legend(fontsize=8)
    fig.suptitle(f"dbo DBO vs serial, {result.options.backend}, {result.env.get('device_name')} "
                 f"x{result.env.get('world_size')}", fontsize=10)
    fig.tight_layout()
    with whole_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
