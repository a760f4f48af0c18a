"""Summaries, the text table and the plot of the overlap benchmark (``dbo.bench overlap``).

Definitions (per shape; every time is per MoE layer: a step's time over its layers):

* ``compute``: the compute-alone time.
* ``comm``: the fastest communication-alone configuration (over DeepEP SM counts).
* ``serial``: the fastest serial configuration (over SM counts).
* ``dbo``: the fastest DBO configuration (likewise, and over the SM carve-outs tried); all are
  in the JSON.
* ``speedup = serial / dbo``; ``efficiency = (serial - dbo) / min(compute, comm)``: the
  share of the hideable time that was hidden (1: perfect overlap; 0: none).
* ``merged``: the fastest DBO configuration with the merged expert schedule (one experts call
  per layer over both ubatches' rows); ``merged_speedup = serial / merged``; ``merged_compute``:
  its compute alone (the same replayed communication as ``dbo_compute``); ``best_schedule``:
  the fastest of ``plain`` (serial), ``split`` (dbo) and ``merged``.
* ``untuned_wrapper_vs_serial`` (``untun``): the wrapper with the default, adaptive
  :class:`dbo.split.SplitConfig` (nobody tuned it: it times plain and overlapped on its first
  calls and keeps the faster; ``online_choice``), timed after that choice alternately with
  the best serial configuration (``serial_paired_untuned``) and divided by it.
* ``peak_ratio``: peak memory of the best DBO configuration over that of the best serial one
  (``torch.cuda.max_memory_allocated``, weights included); ``peak_extra_ratio``: the same for
  the memory allocated during the step only.
* ``link`` and ``x link``: the link limit of the comm column (``dbo.bench.overlap.link``: the bytes this
  backend moves out of a rank per layer over the copy-engine put rate measured at the start of
  the run) and ``comm / link``.
* ``wrapper``: the overlapped forward deciding by itself, over the serial time: measured with
  the config that ``dbo.autotune`` tuned on the same grid (the default, unless
  ``--no-autotune``), alternating with the best serial configuration for three rounds and
  divided by that paired serial time (``serial_paired``); otherwise what the default
  :class:`dbo.split.SplitConfig` would run (DBO when its thresholds split this batch, else
  serial), over the serial time.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from dbo.bench.limits import rate_text

__all__ = ["summarize_shape", "format_table", "write_plot"]


def _best(meas: list[dict], mode: str, **match: Any) -> dict | None:
    cands = [m for m in meas if m["mode"] == mode and m.get("timing")
             and all(m.get(k) == v for k, v in match.items())]
    return min(cands, key=lambda m: m["timing"]["median_ms"]) if cands else None


def _ms(m: dict | None, layers: int) -> float | None:
    return None if m is None else m["timing"]["median_ms"] / layers


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _cfg(m: dict | None) -> str:
    if m is None:
        return "-"
    parts = [f"s{m['num_sms']}" if m.get("num_sms") is not None else "",
             f"k{m['sm_carveout']}" if m.get("sm_carveout") is not None else ""]
    return " ".join(p for p in parts if p) or "-"


def summarize_shape(shape: dict, default_splits: bool) -> dict:
    """The summary of one shape's measurements (see the module docstring)."""
    meas, layers = shape["measurements"], shape["layers"]
    compute, comm = _best(meas, "compute"), _best(meas, "comm")
    serial, dbo = _best(meas, "serial"), _best(meas, "dbo")
    t_compute, t_comm = _ms(compute, layers), _ms(comm, layers)
    t_serial, t_dbo = _ms(serial, layers), _ms(dbo, layers)
    hideable = None if t_compute is None or t_comm is None else min(t_compute, t_comm)

    def eff(t_d: float | None) -> float | None:
        if t_serial is None or t_d is None or not hideable:
            return None
        return (t_serial - t_d) / hideable

    out: dict[str, Any] = {
        "compute_ms": t_compute, "compute_config": _cfg(compute),
        "comm_ms": t_comm, "comm_config": _cfg(comm),
        "serial_ms": t_serial, "serial_config": _cfg(serial),
        "dbo_ms": t_dbo, "dbo_config": _cfg(dbo),
        "dbo_compute_ms": _ms(_best(meas, "dbo_compute"), layers),
        "speedup": _ratio(t_serial, t_dbo),
        "efficiency": eff(t_dbo),
        "comm_share": _ratio(t_comm, t_serial),
        "ideal_ms": None if t_compute is None or t_comm is None else max(t_compute, t_comm),
        "peak_ratio": _ratio(*(None if m is None else m["timing"].get("peak_bytes") for m in (dbo, serial))),
        "peak_extra_ratio": _ratio(*(None if m is None else m["timing"].get("peak_extra_bytes")
                                     for m in (dbo, serial))),
        "default_config_splits": default_splits,
    }
    merged = _best(meas, "merged")
    t_merged = _ms(merged, layers)
    out.update(merged_ms=t_merged, merged_config=_cfg(merged),
               merged_compute_ms=_ms(_best(meas, "merged_compute"), layers),
               merged_speedup=_ratio(t_serial, t_merged), merged_efficiency=eff(t_merged))
    t_sbo = _ms(_best(meas, "sbo"), layers)
    out.update(sbo_ms=t_sbo, sbo_speedup=_ratio(t_serial, t_sbo))
    t_sbo_dbo = _ms(_best(meas, "sbo_dbo"), layers)
    out.update(sbo_dbo_ms=t_sbo_dbo, sbo_dbo_speedup=_ratio(t_serial, t_sbo_dbo))
    timed = [(t, k, name) for k, (name, t) in enumerate((("plain", t_serial), ("split", t_dbo),
                                                          ("merged", t_merged), ("sbo", t_sbo),
                                                          ("sbo+dbo", t_sbo_dbo)))
             if t is not None]
    out["best_schedule"] = min(timed)[2] if timed else None
    out["comm_bytes"] = shape.get("comm_bytes_per_layer")
    out["link_ms"] = shape.get("link_ms_per_layer")
    out["comm_x_link"] = _ratio(t_comm, out["link_ms"])
    limit = (shape.get("limit_ms_per_layer") or {}).get("total")
    out["limit_ms"] = limit
    out["compute_x_limit"] = _ratio(t_compute, limit)
    out["dbo_compute_over_compute"] = _ratio(out["dbo_compute_ms"], t_compute)
    out["merged_compute_over_compute"] = _ratio(out["merged_compute_ms"], t_compute)
    measured = _ms(_best(meas, "wrapper"), layers)
    paired = _ms(_best(meas, "serial_paired"), layers)
    wrapper = measured if measured is not None else (t_dbo if default_splits else t_serial)
    out["wrapper_ms"] = wrapper
    out["wrapper_measured"] = measured is not None
    out["serial_paired_ms"] = paired
    # against the serial forward timed alternately with it when there is one (same minutes)
    out["wrapper_vs_serial"] = _ratio(wrapper, paired if measured is not None and paired else t_serial)
    out["wrapper_vs_serial_unpaired"] = _ratio(wrapper, t_serial)
    # the untuned wrapper: the default SplitConfig, adaptive (it measured plain against overlapped)
    untuned = _ms(_best(meas, "wrapper_untuned"), layers)
    paired_u = _ms(_best(meas, "serial_paired_untuned"), layers)
    out["untuned_wrapper_ms"] = untuned
    out["untuned_wrapper_vs_serial"] = _ratio(untuned, paired_u) if untuned is not None else None
    out["online_choice"] = (shape.get("online_choice") or {}).get("chose")
    sms = sorted({m["num_sms"] for m in meas if m.get("num_sms") is not None})
    out["per_num_sms"] = [{
        "num_sms": s,
        "comm_ms": _ms(_best(meas, "comm", num_sms=s), layers),
        "serial_ms": _ms(_best(meas, "serial", num_sms=s), layers),
        "dbo_ms": _ms(_best(meas, "dbo", num_sms=s), layers),
        "dbo_config": _cfg(_best(meas, "dbo", num_sms=s)),
        "speedup": _ratio(t_serial, _ms(_best(meas, "dbo", num_sms=s), layers)),
        "efficiency": eff(_ms(_best(meas, "dbo", num_sms=s), layers)),
    } for s in sms]
    return out


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


def format_table(bundle: dict) -> str:
    """The short text table printed at the end (per-layer milliseconds)."""
    env, args = bundle["env"], bundle["args"]
    where = f"world={env.get('world_size')}"
    if args.get("emulate_ep"):
        where = (f"emulated rank {args['emulate_rank']} of EP{args['emulate_ep']} "
                 f"({args['emulate_layout']} layout, {args['gpus_per_host']} GPUs a host; not modelled: "
                 "incast, congestion, stragglers, routing skew, DeepEP's SMs)")
    lines = [f"dbo bench_overlap: backend={args['backend']} {where} "
             f"device={env.get('device_name')} layers/step={args['layers']} hidden={args['hidden']} "
             f"experts={args['experts']} top-{args['topk']} attn_width={args['attn_width']}{_link(env)}",
             f"times per layer in ms: median of {args['steps']} steps (step time = slowest rank); "
             "cfg sN = DeepEP SMs, kN = DBO SM carve-out; dbo = split schedule, merged = one "
             "experts call per layer (m-cmp: its compute alone), sbo = unsplit, shared experts "
             "beside the dispatch, a combine per expert group"]
    off = bool(env.get("dbo_disabled"))
    if off:
        lines.append("DBO_DISABLE=1: DBO was disabled in this run; every plan was unsplit, so the "
                     "DBO columns (dbo, dbo-cmp, wrap, untun, merged, m-cmp) timed the plain forward "
                     "and their speedups read 'off'")
    head = (f"{'tokens':>6} {'I':>5} {'compute':>8} {'comm':>7} {'x link':>6} {'comm%':>5} {'serial':>7} "
            f"{'[cfg]':>8} "
            f"{'dbo':>7} {'[cfg]':>8} {'speedup':>7} {'eff':>5} {'dbo-cmp':>7} {'peak':>5} {'peak+':>5} "
            f"{'wrap':>5} {'untun':>5} {'merged':>7} {'m-cmp':>7} {'sbo':>7} {'best':>6}")
    lines.append(head)
    for sh in bundle["shapes"]:
        s = sh.get("summary") or {}
        share = s.get("comm_share")
        lines.append(
            f"{sh['tokens']:>6} {sh['intermediate']:>5} {_f(s.get('compute_ms')):>8} "
            f"{_f(s.get('comm_ms')):>7} {_f(s.get('comm_x_link')):>6} "
            f"{_f(None if share is None else 100 * share, '.0f'):>5} "
            f"{_f(s.get('serial_ms')):>7} {s.get('serial_config', '-'):>8} {_f(s.get('dbo_ms')):>7} "
            f"{s.get('dbo_config', '-'):>8} {'off' if off else _f(s.get('speedup'), '.3f'):>7} "
            f"{'off' if off else _f(s.get('efficiency')):>5} {_f(s.get('dbo_compute_ms')):>7} "
            f"{_f(s.get('peak_ratio')):>5} {_f(s.get('peak_extra_ratio')):>5} "
            f"{_f(s.get('wrapper_vs_serial'), '.3f'):>5} {_f(s.get('untuned_wrapper_vs_serial'), '.3f'):>5} "
            f"{_f(s.get('merged_ms')):>7} "
            f"{_f(s.get('merged_compute_ms')):>7} {_f(s.get('sbo_ms')):>7} "
            f"{'off' if off else s.get('best_schedule') or '-':>6}")
    if any((sh.get("summary") or {}).get("per_num_sms") for sh in bundle["shapes"]):
        lines.append("DeepEP SM count (Buffer.set_num_sms): comm alone, best serial/DBO at that count, "
                     "speedup and efficiency against the best serial overall")
        lines.append(f"{'tokens':>6} {'I':>5} {'sms':>4} {'comm':>7} {'serial':>7} {'dbo':>7} {'[cfg]':>8} "
                     f"{'speedup':>7} {'eff':>5}")
        for sh in bundle["shapes"]:
            for r in (sh.get("summary") or {}).get("per_num_sms", []):
                lines.append(f"{sh['tokens']:>6} {sh['intermediate']:>5} {r['num_sms']:>4} "
                             f"{_f(r['comm_ms']):>7} {_f(r['serial_ms']):>7} {_f(r['dbo_ms']):>7} "
                             f"{r['dbo_config']:>8} {'off' if off else _f(r['speedup'], '.3f'):>7} "
                             f"{'off' if off else _f(r['efficiency']):>5}")
    graphs = [sh for sh in bundle["shapes"] if sh.get("cuda_graph")]
    if graphs:
        lines.append("CUDA graph (whole step captured; per layer ms): eager serial/DBO, replayed "
                     "serial/DBO, DBO replay == eager DBO, replayed merged and sbo schedules and "
                     "their ratios to serial")
        lines.append(f"{'tokens':>6} {'I':>5} {'eager-s':>7} {'eager-d':>7} {'graph-s':>7} {'graph-d':>7} "
                     f"{'d/s':>6} {'equal':>6} {'graph-m':>7} {'m/s':>6} {'graph-b':>7} {'b/s':>6}")
        for sh in graphs:
            g = sh["cuda_graph"]
            if not g.get("ok"):
                lines.append(f"{sh['tokens']:>6} {sh['intermediate']:>5} FAILED: {g.get('error', '?')[:90]}")
                continue
            lines.append(f"{sh['tokens']:>6} {sh['intermediate']:>5} {_f(g['eager_serial_ms']):>7} "
                         f"{_f(g['eager_dbo_ms']):>7} {_f(g['graph_serial_ms']):>7} "
                         f"{_f(g['graph_dbo_ms']):>7} {_f(g['graph_dbo_over_serial'], '.3f'):>6} "
                         f"{str(g['dbo_replay_equals_eager']):>6} {_f(g.get('graph_merged_ms')):>7} "
                         f"{_f(g.get('graph_merged_over_serial'), '.3f'):>6} {_f(g.get('graph_sbo_ms')):>7} "
                         f"{_f(g.get('graph_sbo_over_serial'), '.3f'):>6}")
    if any((sh.get("summary") or {}).get("limit_ms") for sh in bundle["shapes"]):
        lim = env.get("limits") or {}
        lines.append(f"compute against the limit (per layer; limit = sum over the layer's parts of "
                     f"max(bytes / {rate_text(lim.get('copy_gbps', 0) * 1e9, 'B/s')}, flops / "
                     f"{rate_text(lim.get('gemm_tflops', 0) * 1e12, 'FLOP/s')}), measured in this run; "
                     "x-cmp = split DBO compute / compute, m/cmp = merged DBO compute / compute)")
        lines.append(f"{'tokens':>6} {'I':>5} {'compute':>8} {'limit':>7} {'x lim':>6} {'dbo-cmp':>7} "
                     f"{'x-cmp':>6} {'m-cmp':>7} {'m/cmp':>6}")
        for sh in bundle["shapes"]:
            s = sh.get("summary") or {}
            lines.append(f"{sh['tokens']:>6} {sh['intermediate']:>5} {_f(s.get('compute_ms')):>8} "
                         f"{_f(s.get('limit_ms')):>7} {_f(s.get('compute_x_limit')):>6} "
                         f"{_f(s.get('dbo_compute_ms')):>7} "
                         f"{_f(s.get('dbo_compute_over_compute'), '.3f'):>6} "
                         f"{_f(s.get('merged_compute_ms')):>7} "
                         f"{_f(s.get('merged_compute_over_compute'), '.3f'):>6}")
    link = env.get("link")
    if link and any((sh.get("summary") or {}).get("link_ms") for sh in bundle["shapes"]):
        lines.append(f"comm against the link (per layer; link = bytes out of a rank / "
                     f"{rate_text(link['gbps_out'] * 1e9, 'B/s')}, {link['transport']}, measured in this "
                     "run)")
        lines.append(f"{'tokens':>6} {'I':>5} {'comm':>7} {'MB out':>7} {'link':>7} {'x link':>6}")
        for sh in bundle["shapes"]:
            s = sh.get("summary") or {}
            mb = s.get("comm_bytes")
            lines.append(f"{sh['tokens']:>6} {sh['intermediate']:>5} {_f(s.get('comm_ms')):>7} "
                         f"{_f(None if mb is None else mb / 1e6, '.1f'):>7} {_f(s.get('link_ms')):>7} "
                         f"{_f(s.get('comm_x_link')):>6}")
    for cross in [] if off else bundle.get("crossover") or []:
        lines.append(f"I={cross['intermediate']}: DBO faster than serial from "
                     f"{cross.get('eager', '-')} tokens/rank on (eager), {cross.get('graph', '-')} "
                     "(CUDA graph); None: at no size of the grid")
    for inter, tuned in (bundle.get("autotune") or {}).items():
        if not tuned.get("ok"):
            lines.append(f"I={inter}: autotune {tuned.get('error', 'failed')}")
            continue
        lines.append(f"I={inter}: dbo.autotune (per step, both ranks' slowest; 'wrap' above is the "
                     "wrapper measured with this config"
                     + ("; DBO_DISABLE=1: no DBO schedule could be timed" if off else "") + "):")
        lines.extend("  " + ln for ln in tuned["table"].splitlines())
    for w in bundle.get("warnings", []):
        lines.append(f"WARNING: {w}")
    notes = bundle.get("notes") or []
    if notes:  # a CPU run's missed speed targets, under the line that says why they are expected
        lines.append(f"note: {notes[0]}:")
        lines.extend(f"  {n}" for n in notes[1:])
    files = bundle.get("files", {})
    no_plot = "; no PNG plot (matplotlib is not installed)" if "plot" in files and not files["plot"] else ""
    lines.append("bundle: " + ", ".join(f"{k}={v}" for k, v in files.items() if v) + no_plot)
    return "\n".join(lines)


def write_plot(bundle: dict, path: str) -> str | None:
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
        _draw(plt, bundle, path)
        return path
    finally:
        log.setLevel(level)


def _draw(plt: Any, bundle: dict, path: str) -> None:
    shapes = [sh for sh in bundle["shapes"] if sh.get("summary")]
    labels = [f"T={sh['tokens']}\nI={sh['intermediate']}" for sh in shapes]
    x = list(range(len(shapes)))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(shapes) + 4), 4.5))
    ax = axes[0]
    ax.plot(x, [sh["summary"].get("speedup") or float("nan") for sh in shapes], "o-", label="best DBO")
    sms = sorted({r["num_sms"] for sh in shapes for r in sh["summary"].get("per_num_sms", [])})
    for s in sms:
        ys = [next((r["speedup"] for r in sh["summary"]["per_num_sms"] if r["num_sms"] == s), None)
              for sh in shapes]
        ax.plot(x, [float("nan") if y is None else y for y in ys], ".--", label=f"DeepEP {s} SMs")
    if any(sh.get("cuda_graph", {}).get("ok") for sh in shapes):
        ys = [(sh.get("cuda_graph") or {}).get("graph_serial_over_dbo") for sh in shapes]
        ax.plot(x, [float("nan") if y is None else y for y in ys], "s-", label="CUDA graph")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("speedup = serial / DBO" + (" (DBO_DISABLE=1: DBO was off)"
                                             if bundle["env"].get("dbo_disabled") else ""))
    ax.set_xticks(x, labels, fontsize=8)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(x, [sh["summary"].get("efficiency") or 0.0 for sh in shapes], color="tab:green")
    ax.axhline(0.6, color="tab:red", lw=0.8, ls="--", label="target 0.6")
    ax.set_title("overlap efficiency = (serial - DBO) / min(compute, comm)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.legend(fontsize=8)
    args = bundle["args"]
    fig.suptitle(f"dbo DBO vs serial, {args['backend']}, {bundle['env'].get('device_name')} "
                 f"x{bundle['env'].get('world_size')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
