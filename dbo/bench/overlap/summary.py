"""The summary of one shape of the overlap benchmark: the figures the table, the plot and
``dbo.bench compare`` read, computed from the shape's measurements (:func:`summarize`).

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

from collections.abc import Iterable
from typing import Any

from dbo.bench.overlap.record import Measurement, ShapeRecord, ShapeSummary, SmsRow

__all__ = ["ShapeSummary", "SmsRow", "summarize", "best_measurement"]


def best_measurement(meas: Iterable[Measurement], mode: str, *, num_sms: Any = ...) -> Measurement | None:
    """The fastest timed run of ``mode`` (at DeepEP SM count ``num_sms`` where given)."""
    cands = [m for m in meas if m.mode == mode and m.timing is not None
             and (num_sms is ... or m.num_sms == num_sms)]
    return min(cands, key=lambda m: m.timing.median_ms) if cands else None


def _ms(m: Measurement | None, layers: int) -> float | None:
    return None if m is None else m.timing.median_ms / layers


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _cfg(m: Measurement | None) -> str:
    if m is None:
        return "-"
    parts = [f"s{m.num_sms}" if m.num_sms is not None else "",
             f"k{m.sm_carveout}" if m.sm_carveout is not None else ""]
    return " ".join(p for p in parts if p) or "-"


def summarize(shape: ShapeRecord, default_splits: bool, wrapper_config: str | None = None) -> ShapeSummary:
    """The summary of ``shape``'s measurements (see the module docstring). ``default_splits``:
    whether the default :class:`dbo.split.SplitConfig` splits this batch; ``wrapper_config``:
    "autotuned" where the wrapper was timed with the autotune's config."""
    meas, layers = shape.measurements, shape.layers

    def best(mode: str, **match: Any) -> Measurement | None:
        return best_measurement(meas, mode, **match)

    compute, comm = best("compute"), best("comm")
    serial, dbo = best("serial"), best("dbo")
    t_compute, t_comm = _ms(compute, layers), _ms(comm, layers)
    t_serial, t_dbo = _ms(serial, layers), _ms(dbo, layers)
    hideable = None if t_compute is None or t_comm is None else min(t_compute, t_comm)

    def eff(t_d: float | None) -> float | None:
        if t_serial is None or t_d is None or not hideable:
            return None
        return (t_serial - t_d) / hideable

    def peak(attr: str) -> float | None:
        return _ratio(*(None if m is None else getattr(m.timing, attr) for m in (dbo, serial)))

    merged = best("merged")
    t_merged = _ms(merged, layers)
    t_sbo = _ms(best("sbo"), layers)
    t_sbo_dbo = _ms(best("sbo_dbo"), layers)
    timed = [(t, k, name) for k, (name, t) in enumerate((("plain", t_serial), ("split", t_dbo),
                                                          ("merged", t_merged), ("sbo", t_sbo),
                                                          ("sbo+dbo", t_sbo_dbo)))
             if t is not None]
    t_dbo_compute = _ms(best("dbo_compute"), layers)
    t_merged_compute = _ms(best("merged_compute"), layers)
    link_ms = shape.link_ms_per_layer
    limit = (shape.limit_ms_per_layer or {}).get("total")
    measured = _ms(best("wrapper"), layers)
    paired = _ms(best("serial_paired"), layers)
    wrapper = measured if measured is not None else (t_dbo if default_splits else t_serial)
    untuned = _ms(best("wrapper_untuned"), layers)
    paired_u = _ms(best("serial_paired_untuned"), layers)
    sms = sorted({m.num_sms for m in meas if m.num_sms is not None})
    return ShapeSummary(
        compute_ms=t_compute, compute_config=_cfg(compute),
        comm_ms=t_comm, comm_config=_cfg(comm),
        serial_ms=t_serial, serial_config=_cfg(serial),
        dbo_ms=t_dbo, dbo_config=_cfg(dbo),
        dbo_compute_ms=t_dbo_compute,
        speedup=_ratio(t_serial, t_dbo),
        efficiency=eff(t_dbo),
        comm_share=_ratio(t_comm, t_serial),
        ideal_ms=None if t_compute is None or t_comm is None else max(t_compute, t_comm),
        peak_ratio=peak("peak_bytes"),
        peak_extra_ratio=peak("peak_extra_bytes"),
        default_config_splits=default_splits,
        merged_ms=t_merged, merged_config=_cfg(merged), merged_compute_ms=t_merged_compute,
        merged_speedup=_ratio(t_serial, t_merged), merged_efficiency=eff(t_merged),
        sbo_ms=t_sbo, sbo_speedup=_ratio(t_serial, t_sbo),
        sbo_dbo_ms=t_sbo_dbo, sbo_dbo_speedup=_ratio(t_serial, t_sbo_dbo),
        best_schedule=min(timed)[2] if timed else None,
        comm_bytes=shape.comm_bytes_per_layer,
        link_ms=link_ms,
        comm_x_link=_ratio(t_comm, link_ms),
        limit_ms=limit,
        compute_x_limit=_ratio(t_compute, limit),
        dbo_compute_over_compute=_ratio(t_dbo_compute, t_compute),
        merged_compute_over_compute=_ratio(t_merged_compute, t_compute),
        wrapper_ms=wrapper,
        wrapper_measured=measured is not None,
        serial_paired_ms=paired,
        # against the serial forward timed alternately with it when there is one (same minutes)
        wrapper_vs_serial=_ratio(wrapper, paired if measured is not None and paired else t_serial),
        wrapper_vs_serial_unpaired=_ratio(wrapper, t_serial),
        # the untuned wrapper: the default SplitConfig, adaptive (it measured plain against overlapped)
        untuned_wrapper_ms=untuned,
        untuned_wrapper_vs_serial=_ratio(untuned, paired_u) if untuned is not None else None,
        online_choice=(shape.online_choice or {}).get("chose"),
        per_num_sms=tuple(SmsRow(
            num_sms=s,
            comm_ms=_ms(best("comm", num_sms=s), layers),
            serial_ms=_ms(best("serial", num_sms=s), layers),
            dbo_ms=_ms(best("dbo", num_sms=s), layers),
            dbo_config=_cfg(best("dbo", num_sms=s)),
            speedup=_ratio(t_serial, _ms(best("dbo", num_sms=s), layers)),
            efficiency=eff(_ms(best("dbo", num_sms=s), layers)),
        ) for s in sms),
        wrapper_config=wrapper_config,
    )
