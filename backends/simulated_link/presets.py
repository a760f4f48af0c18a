"""Named links calibrated from DeepEP's published internode figures, with the fit that made them.

DeepEP's README gives what its low-latency kernels take across hosts (H800, one 400 Gb/s
ConnectX-7 NIC per GPU; 128 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 dispatch,
BF16 combine), dispatch and combine per call, at EP 16/32/64/128/256 (:data:`DEEPEP_LL_TABLE`).
Its test counts 7408 bytes per dispatched (token, expert) pair (the FP8 row and its scales) and
14336 per combined pair. With 8 GPUs a host, ``(EP - 8) / EP`` of the pairs leave the host, so a
call moves ``(EP - 8) / EP * 128 * 8 * bytes_per_pair`` over the NIC, and::

    us = fixed (one for dispatch, one for combine) + remote bytes / rate

:func:`fit_deepep_ll` fits the two fixed costs and the one rate to the ten figures (least squares
of the relative error); :data:`PRESETS` holds the result as ``deepep-ib`` (decode, the
low-latency kernels). ``deepep-ib-ht`` is the normal kernels' measured rate over RDMA (43-58 GB/s
per GPU at EP 16-64, 4096 tokens; the middle, 50 GB/s) with the low-latency fit's fixed costs,
which DeepEP does not publish for normal mode (a prefill call's bytes dwarf them).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEEPEP_LL_TABLE", "DEEPEP_LL_SHAPE", "LinkFit", "fit_deepep_ll", "PRESETS", "preset_names",
           "fit_report"]

#: EP size -> (dispatch us, combine us), DeepEP's README (low-latency kernels, H800 + CX7 IB)
DEEPEP_LL_TABLE: dict[int, tuple[float, float]] = {
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
    256: (194.0, 360.0),
}

#: the shape of those figures: tokens per rank, top-k, bytes per dispatched and combined pair,
#: hidden, experts, GPUs per host
DEEPEP_LL_SHAPE = {"tokens": 128, "topk": 8, "dispatch_pair_bytes": 7408, "combine_pair_bytes": 14336,
                   "hidden": 7168, "num_experts": 256, "gpus_per_host": 8}


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: the fixed costs (us) and the rate (GB/s), with each figure's model and
    relative residual, ``{ep: (dispatch_model_us, combine_model_us, dispatch_res, combine_res)}``."""

    dispatch_fixed_us: float
    combine_fixed_us: float
    gbps: float
    rows: dict[int, tuple[float, float, float, float]]

    @property
    def worst_residual(self) -> float:
        return max(max(abs(r[2]), abs(r[3])) for r in self.rows.values())


def remote_pair_bytes(ep: int, pair_bytes: float, shape: dict = DEEPEP_LL_SHAPE) -> float:
    """Bytes one rank's low-latency call sends off its host at EP ``ep`` under uniform routing."""
    share = max(ep - shape["gpus_per_host"], 0) / ep
    return share * shape["tokens"] * shape["topk"] * pair_bytes


def fit_deepep_ll(table: dict[int, tuple[float, float]] = DEEPEP_LL_TABLE) -> LinkFit:
    """Fit ``fixed_dispatch``, ``fixed_combine`` and one rate to ``table`` (relative least
    squares over every figure; a 3x3 normal-equation solve, no numpy needed)."""
    rows, ys = [], []
    for ep, (d, c) in table.items():
        rows.append((1.0, 0.0, remote_pair_bytes(ep, DEEPEP_LL_SHAPE["dispatch_pair_bytes"])))
        ys.append(d)
        rows.append((0.0, 1.0, remote_pair_bytes(ep, DEEPEP_LL_SHAPE["combine_pair_bytes"])))
        ys.append(c)
    # weight each equation by 1 / y: minimise the relative error
    a = [[x / y for x in row] for row, y in zip(rows, ys, strict=True)]
    b = [1.0] * len(ys)
    ata = [[sum(r[i] * r[j] for r in a) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * bi for r, bi in zip(a, b, strict=True)) for i in range(3)]
    fd, fc, us_per_byte = _solve3(ata, atb)
    gbps = 1.0 / us_per_byte / 1e3
    out = {}
    for ep, (d, c) in table.items():
        md = fd + remote_pair_bytes(ep, DEEPEP_LL_SHAPE["dispatch_pair_bytes"]) * us_per_byte
        mc = fc + remote_pair_bytes(ep, DEEPEP_LL_SHAPE["combine_pair_bytes"]) * us_per_byte
        out[ep] = (md, mc, md / d - 1.0, mc / c - 1.0)
    return LinkFit(fd, fc, gbps, out)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Solve a 3x3 linear system by Gaussian elimination with partial pivoting."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return a[0][3] / a[0][0], a[1][3] / a[1][1], a[2][3] / a[2][2]


_FIT = fit_deepep_ll()

#: name -> (gbps, dispatch fixed us, combine fixed us)
PRESETS: dict[str, tuple[float, float, float]] = {
    "deepep-ib": (round(_FIT.gbps, 2), round(_FIT.dispatch_fixed_us, 2), round(_FIT.combine_fixed_us, 2)),
    "deepep-ib-ht": (50.0, round(_FIT.dispatch_fixed_us, 2), round(_FIT.combine_fixed_us, 2)),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def fit_report(fit: LinkFit | None = None) -> str:
    """The fit and its residuals, one line per EP size (what ``--link deepep-ib`` stands on)."""
    fit = fit or _FIT
    lines = [f"deepep-ib: dispatch {fit.dispatch_fixed_us:.1f} us + combine {fit.combine_fixed_us:.1f} us "
             f"fixed, {fit.gbps:.1f} GB/s, fitted to DeepEP's low-latency table (remote share (EP-8)/EP; "
             f"worst residual {fit.worst_residual:.1%})",
             "  EP  dispatch us (model, residual)   combine us (model, residual)"]
    for ep, (md, mc, rd, rc) in fit.rows.items():
        d, c = DEEPEP_LL_TABLE[ep]
        lines.append(f"  {ep:>3}  {d:6.0f} ({md:6.1f}, {rd:+.1%})          {c:6.0f} ({mc:6.1f}, {rc:+.1%})")
    return "\n".join(lines)
