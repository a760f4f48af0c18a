"""The table and the verdict of ``python -m dbo.bench hf-generate`` (:mod:`dbo.bench.hf.generate`):
its rows printed with the model they decoded, the verdict on every DBO row's tokens, and the
faster of transformers' two ``generate()`` rows that dbo's speed-ups are quoted against.
"""

from __future__ import annotations

import torch

from dbo.bench.cli import legend
from dbo.bench.hf.options import GenerateOptions, describe_emulated

__all__ = ["TF_SLACK", "fastest_generate_ms", "verdict_reason", "model_name", "print_table"]

#: how far below the plain row's teacher-forced share another row's may fall
TF_SLACK = 0.02


def fastest_generate_ms(rows: list[dict]) -> float:
    """The faster of transformers' generate() rows (eager, static cache) that ran: what dbo's
    speed-ups are quoted against."""
    return min(r["ms"] for r in rows if r.get("mode", "").startswith("hf-") and "ms" in r)


def verdict_reason(a: GenerateOptions, rows: list[dict], dbo_disabled: bool = False) -> tuple[bool, str]:
    """(passed, why) for the run's last line: every DBO row's tokens are its plain row's (see
    :mod:`dbo.bench.hf.generate`). ``dbo_disabled``: ``DBO_DISABLE`` was set (the DBO rows ran
    the plain forward), which the line then says first."""
    dbo_rows = [r for r in rows if r.get("mode") not in (None, "plain", "hf-eager", "hf-static")]
    fp32 = a.model.dtype == torch.float32
    # every row's new tokens must be the teacher-forced forward's choices, up to near ties, as
    # nearly as the plain row's are: that checks each decode step, not the first token only
    plain_tf = min((r["teacher_forced"] for r in rows if r.get("mode") == "plain"), default=1.0)
    bad = [r for r in dbo_rows if (r["same_plain"] < 1.0 if fp32 else r["first_plain"] < 0.75)
           or r["teacher_forced"] < min(plain_tf, 1.0) - TF_SLACK]
    wrote = f"; wrote {a.model.json}" if a.model.json else ""
    off = ("DBO_DISABLE=1: DBO was disabled, every DBO row ran the plain forward (what follows "
           "checks plain against plain); " if dbo_disabled else "")
    ok, why = _verdict(rows, dbo_rows, plain_tf, bad, fp32, wrote)
    return ok, off + why


def _verdict(rows: list[dict], dbo_rows: list[dict], plain_tf: float, bad: list[dict], fp32: bool,
             wrote: str) -> tuple[bool, str]:
    if not dbo_rows:
        return True, f"plain rows only{wrote}"
    if bad:
        return False, ("DBO's tokens differ from plain's in " + ", ".join(
            f"{r['run']} (identical {r['same_plain']:.2f}, first token {r['first_plain']:.2f}, "
            f"teacher-forced {r['teacher_forced']:.3f} against plain's {plain_tf:.3f})" for r in bad)
            + wrote)
    if fp32:
        return True, f"every DBO run's tokens equal its plain run's ({len(dbo_rows)} runs){wrote}"
    low = min(r["first_plain"] for r in dbo_rows)
    tf_low = min(r["teacher_forced"] for r in dbo_rows)
    return True, (f"every DBO run's first new token agrees with plain's for >= 75% of sequences "
                  f"(lowest {low:.2f}; {len(dbo_rows)} runs), and its new tokens are a plain "
                  f"forward's choices as often as plain's (lowest {tf_low:.3f}, plain {plain_tf:.3f})"
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


def print_table(a: GenerateOptions, rows: list[dict], world: int, device: torch.device,
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
    print(f"\n{model_name(a)}: batch {a.batch} x prompt {a.prompt} + {a.new_tokens} new tokens per rank, "
          f"{where}, {a.model.dtype_name}{link}; slowest rank\n")
    print(f"| run | ms | fastest-slowest call | prefill ms | new tokens/s per {per} | identical "
          "| before 1st diff | identical to plain | teacher-forced |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['run']} | failed: {r['error']} | - | - | - | - | - | - | - |")
            continue
        spread = f"{r['ms_min']:.1f}-{r['ms_max']:.1f}" if "ms_min" in r else "-"
        tf = f"{r['teacher_forced']:.3f}" if "teacher_forced" in r else "-"
        print(f"| {r['run']} | {r['ms']:.1f} | {spread} | {r['prefill_ms']:.1f} | {r['tok_s']:,.0f} "
              f"| {r['same']:.2f} | {r['prefix']:.2f} | {r.get('same_plain', 1.0):.2f} | {tf} |")
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
    best = min((r for r in rows if r.get("mode") not in (None, "hf-eager", "hf-static") and "ms" in r),
               key=lambda r: r["ms"], default=None)
    if best is not None:
        print(f"\nfastest dbo run: {best['run']}, {fastest / best['ms']:.2f}x the faster of transformers' "
              f"generate() rows ({fastest:.1f} ms)")


def _print_overlapped_against_plain(rows: list[dict]) -> None:
    """An emulated rank's last lines: the fastest overlapped row against the plain row, and
    against the plain graph row where it ran (there is no generate() row to quote)."""
    plain_modes = ("plain", "plain, graph decode")
    timed = {r["mode"]: r for r in rows if "ms" in r}
    overlapped = [r for r in timed.values() if r["mode"] not in plain_modes]
    if not overlapped:
        return
    best = min(overlapped, key=lambda r: r["ms"])
    print()
    for mode in plain_modes:
        if mode in timed:
            print(f"fastest overlapped run: {best['run']}, {timed[mode]['ms'] / best['ms']:.2f}x "
                  f"{timed[mode]['run']} ({timed[mode]['ms']:.1f} ms)")
