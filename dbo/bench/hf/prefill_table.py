"""``hf-prefill``'s results: the check of one row, the run's record (:class:`PrefillResult`, its
:class:`PrefillRow` list), the markdown table, the JSON file and the verdict line.

A row: ``backend`` (its label), ``batch``, ``seq``, ``plain_ms``, ``dbo_ms`` (None for a row
without DBO), ``rel_err`` and ``top1_agree`` (DBO against plain; the unconverted model against
the converted one), ``ok`` (None: not checked), ``split`` (the plan, or why the row could not
run), and where measured ``expert_schedule``, ``autotune``, ``plain_peak_gib`` /
``dbo_peak_gib`` (CUDA only) and ``rel_vs_a2a`` (against transformers' own all_to_all model).
Times are the slowest rank's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dbo.bench.cli import legend
from dbo.bench.hf.options import describe_emulated
from dbo.files import write_whole

__all__ = ["PrefillRow", "PrefillResult", "logits_match", "print_table", "write_json", "verdict_reason"]


@dataclass(frozen=True)
class PrefillRow:
    """One row of the table (see the module docstring)."""

    backend: str
    batch: int
    seq: int
    plain_ms: float | None
    dbo_ms: float | None
    rel_err: float | None
    top1_agree: float | None
    ok: bool | None
    split: str
    expert_schedule: str | None = None
    autotune: dict[str, Any] | None = None
    plain_peak_gib: float | None = None
    dbo_peak_gib: float | None = None
    rel_vs_a2a: float | None = None


@dataclass
class PrefillResult:
    """A run: the model (``preset``, ``checkpoint`` loaded, decoder ``layers``), where it ran
    (``world`` ranks of ``device``, a device name, or ``emulated``: one rank of a larger group
    played alone), its ``dtype`` (torch's name), the ``steps`` timed, whether ``DBO_DISABLE`` was
    set, and its rows so far. ``to_json`` is the ``--json``
    file; ``from_json`` reads one back."""

    preset: str
    checkpoint: str | None
    layers: int
    world: int
    device: str
    dtype: str
    steps: int
    dbo_disabled: bool = False
    rows: list[PrefillRow] = field(default_factory=list)
    #: the emulated rank this one process played (``ModelOptions.emulation_record``), None: a group
    emulated: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefillResult:
        return cls(**{**d, "rows": [PrefillRow(**r) for r in d.get("rows", ())]})


def logits_match(rel_err: float, top1_agree: float, dtype: torch.dtype) -> bool:
    """Whether logits with this relative error and top-1 agreement count as equal: float32 at a
    relative error of at most 1e-4; bfloat16 at most 0.1 or with at least 75% of the top tokens
    agreeing. (bf16: the ubatches' matmuls round differently from the whole batch's, and a one-ulp
    change can flip a near-tie in a later layer's routing, so with many layers of random weights a
    few sequences differ; a wrong split or merge gives an error near 1 and next to no agreement.)"""
    if dtype == torch.float32:
        return rel_err <= 1e-4
    return rel_err <= 0.1 or top1_agree >= 0.75


def _header(result: PrefillResult, *, cuda: bool, hidden: int, build_s: float, link: str) -> str:
    what = f"{result.checkpoint} (loaded expert-parallel)" if result.checkpoint else result.preset
    per = "GPU" if cuda else "rank"
    dtype = result.dtype.removeprefix("torch.")
    where = (f"{result.world} x {result.device}" if result.emulated is None
             else describe_emulated(result.emulated, result.device))
    return (f"{what}: {result.layers} layers, hidden {hidden}, {dtype}, "
            f"{where}; rank 0 {'loaded' if result.checkpoint else 'built'} its "
            f"model in {build_s:.1f} s; median of {result.steps} steps, slowest rank; tokens/s per {per} = "
            f"batch*seq / time{'; ' + link if link else ''}")


def print_table(result: PrefillResult, *, cuda: bool, hidden: int, build_s: float, link: str = "") -> None:
    """Print the header line and the markdown table of ``result``'s rows (rank 0 calls it);
    ``hidden``: the model's hidden size; ``build_s``: how long rank 0 took to build or load it;
    ``link``: the simulated link's description (empty: none). Peak memory is a column on CUDA
    only; the footnote on the unconverted model only where it ran. Under ``DBO_DISABLE`` the
    DBO rows ran the plain forward; a line above the table says so and their speedups read
    ``off``."""
    rows, dbo_disabled = result.rows, result.dbo_disabled
    per = "GPU" if cuda else "rank"
    anchor = any(r.rel_vs_a2a is not None for r in rows)
    cols = ["backend", "batch x seq", "plain ms", "DBO ms", f"plain tok/s per {per}",
            f"DBO tok/s per {per}", "DBO speedup", "rel err", "top-1 agree"]
    cols += ["peak GiB plain / DBO"] if cuda else []
    cols += ["rel vs a2a"] if anchor else []
    print("\n" + _header(result, cuda=cuda, hidden=hidden, build_s=build_s, link=link) + "\n")
    if dbo_disabled:
        print("DBO_DISABLE=1: DBO was disabled in this run; the DBO columns timed the plain forward "
              "and their speedups read 'off'\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        if r.plain_ms is None:  # a row that could not run says why in its split column
            print(f"| {r.backend} | - | {r.split} |" + " |" * (len(cols) - 3))
            continue
        tokens = r.batch * r.seq
        dbo = r.dbo_ms
        cells = [r.backend, f"{r.batch} x {r.seq}", f"{r.plain_ms:.1f}",
                 "" if dbo is None else f"{dbo:.1f}", f"{tokens / r.plain_ms * 1e3:,.0f}",
                 "" if dbo is None else f"{tokens / dbo * 1e3:,.0f}",
                 "" if dbo is None else "off" if dbo_disabled else f"{r.plain_ms / dbo:.2f}x",
                 f"{r.rel_err:.1e}" + ("" if r.ok in (None, True) else " MISMATCH"),
                 f"{r.top1_agree:.2f}"]
        if cuda:
            dbo_peak = "-" if r.dbo_peak_gib is None else f"{r.dbo_peak_gib:.1f}"
            cells.append("-" if r.plain_peak_gib is None else f"{r.plain_peak_gib:.1f} / {dbo_peak}")
        if anchor:
            cells.append("-" if r.rel_vs_a2a is None else f"{r.rel_vs_a2a:.1e}")
        print("| " + " | ".join(cells) + " |")
    print("\n".join(legend({
        "plain ms, DBO ms": "the prefill forward, plain and overlapped (DBOPrefill)",
        "tok/s": "batch*seq / time", "DBO speedup": "plain ms / DBO ms",
        "rel err": "DBO's logits against plain's (relative error; MISMATCH: beyond the tolerance)",
        "top-1 agree": "the share of tokens whose likeliest next token is the same",
        **({"peak GiB": "the step's peak GPU memory"} if cuda else {}),
        **({"rel vs a2a": "this backend's plain logits against the all2all backend's"} if anchor else {}),
    })))
    if any(r.backend == "unconverted" for r in rows):
        print("\n(unconverted: the original model, every expert on every rank, no communication; its "
              "rel err / agreement are against the converted model's plain logits)")


def write_json(result: PrefillResult, path: str | None) -> None:
    """Write ``result`` (its rows so far) to ``path`` (``--json``; None: nothing; call it on
    rank 0: a later failure keeps the rows)."""
    if path:
        write_whole(path, json.dumps(result.to_json(), indent=1))


def verdict_reason(rows: Sequence[PrefillRow | Mapping[str, Any]], json_path: str | None,
                   dbo_disabled: bool = False) -> tuple[bool, str]:
    """(passed, why) for the run's last line: every checked row of ``rows`` (records, or their
    JSON) matched. ``dbo_disabled``: ``DBO_DISABLE`` was set, which the line then says first."""
    rows = [r if isinstance(r, PrefillRow) else PrefillRow(**r) for r in rows]
    dbo_rows = [r for r in rows if r.dbo_ms is not None]
    other = [r for r in rows if r.dbo_ms is None and r.ok is not None]
    bad = [r for r in rows if r.ok is False]
    wrote = f"; wrote {json_path}" if json_path else ""
    if bad:
        names = ", ".join(f"{r.backend} {r.batch}x{r.seq} (rel err {r.rel_err:.1e}, top-1 "
                          f"agree {r.top1_agree:.2f})" for r in bad)
        return False, f"logits differ on {len(bad)} of {len(dbo_rows) + len(other)} rows: {names}{wrote}"
    err = max(r.rel_err for r in dbo_rows)
    why = (f"DBO_DISABLE=1: DBO was disabled, every DBO row ran the plain forward (max rel err "
           f"{err:.1e} against plain)" if dbo_disabled else
           f"DBO matches plain on every row (max rel err {err:.1e})")
    if other:
        why += (f"; the unconverted model matches the converted one (max rel err "
                f"{max(r.rel_err for r in other):.1e})")
    return True, why + wrote
