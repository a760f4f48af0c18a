"""The record, the table and the verdict of ``python -m dbo.bench hf-generate``
(:mod:`dbo.bench.hf.generate`): its rows (:class:`GenerateRow`, in a :class:`GenerateResult`,
the ``--json`` file), printed with the model they decoded, the verdict on every DBO row's tokens, and the
faster of transformers' two ``generate()`` rows that dbo's speed-ups are quoted against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dbo.bench.cli import legend
from dbo.bench.hf.options import GenerateOptions, describe_emulated

__all__ = ["TF_SLACK", "tf_floor", "PLAIN_MODES", "COMPUTE_ALONE", "GenerateRow", "GenerateResult",
           "fastest_generate_ms", "verdict_reason", "model_name", "print_table", "overlap_bound"]

#: how far below the plain row's teacher-forced share another row's may fall at least; where
#: plain's own decode misses its forward's choice more often (bf16 near ties), as far as that share
#: (:func:`tf_floor`)
TF_SLACK = 0.02
#: the rows that run no overlap
PLAIN_MODES = ("plain", "plain, graph decode")
#: an emulated rank's row of the fastest plain mode with the link off: the compute alone
COMPUTE_ALONE = "compute alone"


@dataclass(frozen=True)
class GenerateRow:
    """One row: the ``run`` (its name) and ``mode`` (``hf-eager``, ``hf-static``, or a
    :data:`~dbo.bench.hf.options.GENERATE_MODES` key), ms per whole call (``ms``; ``ms_min`` /
    ``ms_max`` its fastest and slowest call over ``rounds`` rounds where timed interleaved) and
    per one-token call (``prefill_ms``), new tokens/s (``tok_s``), its agreement with
    transformers' ``generate()`` (an emulated rank's: with the plain row) (``same``: sequences
    identical to the end; ``prefix``: mean share of new tokens before the first difference) and,
    for dbo's rows, with its plain row
    (``same_plain``, ``prefix_plain``, ``first_plain``: first new token) and the teacher-forced
    share (``teacher_forced``), the plan (``split``); ``error``: why the row could not run. A
    figure the row does not have is None and left out of its JSON."""

    run: str
    mode: str
    ms: float | None = None
    ms_min: float | None = None
    ms_max: float | None = None
    rounds: int | None = None
    prefill_ms: float | None = None
    tok_s: float | None = None
    same: float | None = None
    prefix: float | None = None
    same_plain: float | None = None
    prefix_plain: float | None = None
    first_plain: float | None = None
    teacher_forced: float | None = None
    split: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerateRow:
        return cls(**d)


@dataclass
class GenerateResult:
    """A run: the ``model`` decoded (:func:`model_name`), ``world`` ranks, ``batch`` sequences
    of ``prompt`` tokens per rank and ``new_tokens`` decoded, whether ``DBO_DISABLE`` was set,
    the overlapped steps' ``sm_carveout``, the rows, and ``emulated``: the emulated rank this one
    process played (``ModelOptions.emulation_record``; None: a group). ``to_json`` is the ``--json`` file (the
    rows last); ``from_json`` reads one back."""

    model: str
    world: int
    batch: int
    prompt: int
    new_tokens: int
    dbo_disabled: bool = False
    rows: list[GenerateRow] = field(default_factory=list)
    emulated: dict[str, Any] | None = None
    sm_carveout: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "rows"},
                "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerateResult:
        return cls(**{**d, "rows": [GenerateRow.from_json(r) for r in d.get("rows", ())]})


def _rows(rows: Iterable[GenerateRow | Mapping[str, Any]]) -> list[GenerateRow]:
    return [r if isinstance(r, GenerateRow) else GenerateRow.from_json(r) for r in rows]


def fastest_generate_ms(rows: Iterable[GenerateRow | Mapping[str, Any]]) -> float:
    """The faster of transformers' generate() rows (eager, static cache) that ran: what dbo's
    speed-ups are quoted against. ``rows``: records, or their JSON."""
    return min(r.ms for r in _rows(rows) if r.mode.startswith("hf-") and r.ms is not None)


def tf_floor(plain_tf: float) -> float:
    """The lowest teacher-forced share a DBO row may have, given the plain row's ``plain_tf``:
    ``plain_tf`` less ``TF_SLACK`` or less plain's own miss share (``1 - plain_tf``), whichever is
    more. Plain's decode misses its own forward's choice where bf16 rounding (a cache against no
    cache) resolves a near tie the other way; the ubatches' smaller matmuls round differently
    again and resolve about as many (``tools/probes/split_noise.py``: DeepSeek-V3's random
    weights, plain over half the batch against the whole flips 5-9% of the first tokens, and DBO
    7%), so DBO may miss up to twice as often as plain. A wrong row, cache or position misses
    nearly every token."""
    plain_tf = min(plain_tf, 1.0)
    return plain_tf - max(TF_SLACK, 1.0 - plain_tf)


def verdict_reason(a: GenerateOptions, rows: list[GenerateRow],
                   dbo_disabled: bool = False) -> tuple[bool, str]:
    """(passed, why) for the run's last line: every DBO row's tokens are its plain row's (see
    :mod:`dbo.bench.hf.generate`). ``dbo_disabled``: ``DBO_DISABLE`` was set (the DBO rows ran
    the plain forward), which the line then says first."""
    dbo_rows = [r for r in rows if r.mode not in ("plain", "hf-eager", "hf-static", COMPUTE_ALONE)]
    fp32 = a.model.dtype == torch.float32
    # every row's new tokens must be the teacher-forced forward's choices, up to near ties, as
    # nearly as the plain row's are: that checks each decode step, not the first token only
    plain_tf = min((r.teacher_forced for r in rows if r.mode == "plain"), default=1.0)
    floor = tf_floor(plain_tf)
    bad = [r for r in dbo_rows if (r.same_plain < 1.0 if fp32 else r.first_plain < 0.75)
           or r.teacher_forced < floor]
    wrote = f"; wrote {a.model.json}" if a.model.json else ""
    off = ("DBO_DISABLE=1: DBO was disabled, every DBO row ran the plain forward (what follows "
           "checks plain against plain); " if dbo_disabled else "")
    ok, why = _verdict(rows, dbo_rows, plain_tf, floor, bad, fp32, wrote)
    return ok, off + why


def _verdict(rows: list[GenerateRow], dbo_rows: list[GenerateRow], plain_tf: float, floor: float,
             bad: list[GenerateRow], fp32: bool, wrote: str) -> tuple[bool, str]:
    if not dbo_rows:
        return True, f"plain rows only{wrote}"
    if bad:
        return False, ("DBO's tokens differ from plain's in " + ", ".join(
            f"{r.run} (identical {r.same_plain:.2f}, first token {r.first_plain:.2f}, "
            f"teacher-forced {r.teacher_forced:.3f} against plain's {plain_tf:.3f}, floor {floor:.3f})"
            for r in bad)
            + wrote)
    if fp32:
        return True, f"every DBO run's tokens equal its plain run's ({len(dbo_rows)} runs){wrote}"
    low = min(r.first_plain for r in dbo_rows)
    tf_low = min(r.teacher_forced for r in dbo_rows)
    return True, (f"every DBO run's first new token agrees with plain's for >= 75% of sequences "
                  f"(lowest {low:.2f}; {len(dbo_rows)} runs), and its new tokens are a plain "
                  f"forward's choices nearly as often as plain's (lowest {tf_low:.3f}, plain {plain_tf:.3f}, "
                  f"floor {floor:.3f})"
                  f"{wrote}")


def model_name(a: GenerateOptions) -> str:
    """The model the run decoded: the preset where this run wrote or built it (an emulated
    rank), else the checkpoint."""
    m = a.model
    if m.emulate_ep is not None:
        return f"{m.preset} ({m.config.num_hidden_layers} layers, random weights)"
    if a.temporary_checkpoint or m.save_checkpoint:
        where = "" if a.temporary_checkpoint else f", written to {m.save_checkpoint}"
        return f"{m.preset} ({m.config.num_hidden_layers} layers, random weights{where})"
    return f"{m.checkpoint} ({m.config.model_type})"


def print_table(a: GenerateOptions, rows: list[GenerateRow], world: int, device: torch.device,
                dbo_disabled: bool = False) -> None:
    """The rows as a table (rank 0); ``dbo_disabled``: a line above it says that the DBO rows
    (marked 'ran plain') timed the plain forward."""
    per = "GPU" if device.type == "cuda" else "rank"
    if dbo_disabled:
        print("\nDBO_DISABLE=1: DBO was disabled in this run; the DBO rows (marked 'ran plain') timed "
              "the plain forward, and their speed says nothing about DBO")
    record = a.model.emulation_record()
    if record is None:
        where, against = f"{world} ranks", "generate()"
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        where, against = describe_emulated(record, name), "the plain row"
    link = "" if a.model.link_model is None else f"; {a.model.link_model.describe()}"
    carve = "" if a.sm_carveout is None else f"; the overlapped steps leave {a.sm_carveout} SMs free"
    print(f"\n{model_name(a)}: batch {a.batch} x prompt {a.prompt} + {a.new_tokens} new tokens per rank, "
          f"{where}, {a.model.dtype_name}{link}{carve}; slowest rank\n")
    print(f"| run | ms | fastest-slowest call | prefill ms | new tokens/s per {per} | identical "
          "| before 1st diff | identical to plain | teacher-forced |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.error is not None:
            print(f"| {r.run} | failed: {r.error} | - | - | - | - | - | - | - |")
            continue
        spread = f"{r.ms_min:.1f}-{r.ms_max:.1f}" if r.ms_min is not None else "-"
        tf = f"{r.teacher_forced:.3f}" if r.teacher_forced is not None else "-"
        same_plain = 1.0 if r.same_plain is None else r.same_plain
        prefill = "-" if r.prefill_ms is None else f"{r.prefill_ms:.1f}"
        print(f"| {r.run} | {r.ms:.1f} | {spread} | {prefill} | {r.tok_s:,.0f} "
              f"| {r.same:.2f} | {r.prefix:.2f} | {same_plain:.2f} | {tf} |")
    print("\n".join(legend({
        "ms": "one greedy decode, prefill included (median)", "fastest-slowest call": "over the timed calls",
        "prefill ms": "the same call with one new token", f"new tokens/s per {per}": "new tokens / time",
        "identical": f"sequences identical to {against}'s to the end",
        "before 1st diff": f"the mean share of new tokens before the first difference from {against}",
        "identical to plain": "the same against this backend's plain row",
        "teacher-forced": "the share of the new tokens that one plain forward over the whole sequences "
                          "also picks (up to near ties)"})))
    if record is not None:
        _print_overlapped_against_plain(rows)
        return
    fastest = fastest_generate_ms(rows)
    best = min((r for r in rows if r.mode not in ("hf-eager", "hf-static") and r.ms is not None),
               key=lambda r: r.ms, default=None)
    if best is not None:
        print(f"\nfastest dbo run: {best.run}, {fastest / best.ms:.2f}x the faster of transformers' "
              f"generate() rows ({fastest:.1f} ms)")


def _print_overlapped_against_plain(rows: list[GenerateRow]) -> None:
    """An emulated rank's last lines: the fastest overlapped row against the plain row, and
    against the plain graph row where it ran (there is no generate() row to quote); and under a
    link, the bound (:func:`overlap_bound`)."""
    timed = {r.mode: r for r in rows if r.ms is not None}
    overlapped = [r for r in timed.values() if r.mode not in (*PLAIN_MODES, COMPUTE_ALONE)]
    if not overlapped:
        return
    best = min(overlapped, key=lambda r: r.ms)
    print()
    for mode in PLAIN_MODES:
        if mode in timed:
            print(f"fastest overlapped run: {best.run}, {timed[mode].ms / best.ms:.2f}x "
                  f"{timed[mode].run} ({timed[mode].ms:.1f} ms)")
    bound = overlap_bound(rows)
    if bound is not None:
        plain, compute, comm, x = bound
        print(f"bound: {plain.run} ({plain.ms:.1f} ms) over max(compute, comm) = {x:.2f}x; compute: "
              f"the same call with the link off, {compute:.1f} ms; comm: the rest, {comm:.1f} ms")


def overlap_bound(rows: Iterable[GenerateRow | Mapping[str, Any]]
                  ) -> tuple[GenerateRow, float, float, float] | None:
    """An emulated rank's bound on overlap, from the plain row the link-off row repeats (the
    fastest plain mode): ``(that row, compute ms, comm ms, plain / max(compute, comm))``, where
    the compute is the link-off row's time and the comm the rest of the plain row's. None
    without a link-off row."""
    rows = _rows(rows)
    alone = next((r for r in rows if r.mode == COMPUTE_ALONE and r.ms is not None), None)
    if alone is None:
        return None
    plain = min((r for r in rows if r.mode in PLAIN_MODES and r.ms is not None), key=lambda r: r.ms,
                default=None)
    if plain is None:
        return None
    comm = max(0.0, plain.ms - alone.ms)
    return plain, alone.ms, comm, plain.ms / max(alone.ms, comm)
