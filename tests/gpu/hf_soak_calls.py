"""What ``run_hf_soak.py`` calls and what it makes of them: the seeded sequence of calls, memory
flatness after the warm-up, tokens/s at the start and at the end, the verdict, the printed
summary. Pure Python (no torch), so that the tests can hold the verdict against made-up calls.

A call is a dict (the JSON's ``calls``): ``i``, ``kind`` (``"prefill"`` or ``"generate"``),
``batch``, ``seq`` (the padded prompt length), ``tokens`` (the prompts' real tokens),
``new_tokens``, ``split`` (whether the prefill ran as ubatches; None after an error),
``seconds`` (the slowest rank's), ``tokens_s`` (prefill: prompt tokens/s; generate: new tokens/s,
the prefill included), ``allocated`` / ``reserved`` / ``peak_allocated`` (bytes per rank after
the call, ``torch.cuda.memory_allocated`` / ``memory_reserved`` / the call's peak; None on the
CPU), ``rss_mib`` (host resident set per rank), ``error`` (rank 0's ``[type, message]`` chain, or
None) and ``failed_ranks``.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib
from collections.abc import Iterator
from typing import Any

__all__ = ["KINDS", "FLAT_TOLERANCE", "CallSpec", "soak_specs", "flatness", "first_last", "summarize",
           "soak_verdict", "format_summary"]

KINDS = ("prefill", "generate")
#: memory after each call after the warm-up: (max - min) / max at most this ("flat within 1%")
FLAT_TOLERANCE = 0.01


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One soak call: ``kind`` (``"prefill"`` or ``"generate"``), ``seq`` (the padded prompt
    length) and ``pads`` (each sequence's left padding; the batch is ``len(pads)``)."""

    kind: str
    seq: int
    pads: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.pads)

    @property
    def code(self) -> int:
        """A checksum of the call, the same on every rank that makes it (< 2**32)."""
        return zlib.crc32(f"{self.kind}:{self.seq}:{self.pads}".encode())


def soak_specs(seed: int, batches: list[int], min_len: int, max_len: int) -> Iterator[CallSpec]:
    """The soak's calls, endless: the largest prefill and the largest generate first (every
    sequence ``max_len`` real tokens, the largest batch), then prefill and generate in turn, a
    batch from ``batches``, each sequence's real length uniform in ``min_len..max_len``."""
    rng, big = random.Random(seed), max(batches)
    yield CallSpec("prefill", max_len, (0,) * big)
    yield CallSpec("generate", max_len, (0,) * big)
    for i in itertools.count():
        lengths = [rng.randint(min_len, max_len) for _ in range(rng.choice(batches))]
        seq = max(lengths)
        yield CallSpec(("prefill", "generate")[i % 2], seq, tuple(seq - n for n in lengths))


def flatness(values: list[float], tolerance: float = FLAT_TOLERANCE) -> dict[str, Any]:
    """``{"min", "max", "spread", "flat"}`` of ``values`` (bytes): spread = (max - min) / max,
    flat = spread <= ``tolerance``. All None where there are no values."""
    if not values:
        return {"min": None, "max": None, "spread": None, "flat": None}
    lo, hi = min(values), max(values)
    spread = (hi - lo) / hi if hi > 0 else 0.0
    return {"min": lo, "max": hi, "spread": spread, "flat": spread <= tolerance}


def first_last(calls: list[dict], min_window: int = 5) -> dict[str, Any]:
    """``{"first", "last", "window", "calls"}``: tokens per second over the first and over the last
    ``window`` of ``calls`` (in call order): a tenth of them, at least ``min_window`` (the same
    calls where there are fewer than ``2 * window``). Their sizes are random, so a window's total
    tokens over its total seconds, not a median of per-call rates, which hangs on the few calls
    in the middle of the window."""
    if not calls:
        return {"first": None, "last": None, "window": 0, "calls": 0}
    window = max(min_window, len(calls) // 10)

    def rate(part: list[dict]) -> float:
        return sum(c["tokens"] for c in part) / sum(c["seconds"] for c in part)

    return {"first": rate(calls[:window]), "last": rate(calls[-window:]), "window": min(window, len(calls)),
            "calls": len(calls)}


def summarize(calls: list[dict], *, world: int, warmup_calls: int, min_window: int = 5,
              tolerance: float = FLAT_TOLERANCE) -> dict[str, Any]:
    """The soak's figures: ``calls``, ``errors``, ``per_kind`` (calls of each kind), ``memory``
    (per kind of figure, ``allocated`` and ``reserved``: :func:`flatness` per rank over the calls
    after the first ``warmup_calls`` that did not fail, and ``flat``: every rank flat, None where
    nothing was measured, as on the CPU), ``rss_mib`` (per rank: after the warm-up and at the
    end) and ``tokens_s`` (per kind: :func:`first_last` over its calls after the warm-up that
    did not fail)."""
    after = [c for c in calls[warmup_calls:] if c["error"] is None and not c["failed_ranks"]]
    memory: dict[str, Any] = {}
    for key in ("allocated", "reserved"):
        per_rank = [flatness([c[key][r] for c in after if c[key] is not None], tolerance)
                    for r in range(world)]
        flags = [f["flat"] for f in per_rank]
        memory[key] = {"per_rank": per_rank,
                       "flat": None if None in flags else all(flags),
                       "worst_spread": max((f["spread"] for f in per_rank if f["spread"] is not None),
                                           default=None)}
    flags = [memory[k]["flat"] for k in ("allocated", "reserved")]
    rss = [{"after_warmup": after[0]["rss_mib"][r], "end": after[-1]["rss_mib"][r]} if after else None
           for r in range(world)]
    return {
        "calls": len(calls),
        "errors": sum(1 for c in calls if c["error"] is not None or c["failed_ranks"]),
        "per_kind": {k: sum(1 for c in calls if c["kind"] == k) for k in KINDS},
        "measured_calls": len(after),
        "memory": dict(memory, flat=None if None in flags else all(flags), tolerance=tolerance),
        "rss_mib": rss,
        "tokens_s": {k: first_last([c for c in after if c["kind"] == k], min_window)
                     for k in KINDS},
    }


def soak_verdict(summary: dict, check: dict, stopped: str | None, *, judge_memory: bool) -> tuple[bool, str]:
    """``(ok, why)``: ok where DBO matched plain at the start, no call failed, the ranks stayed in
    step and (``judge_memory``: on CUDA) memory was measured after the warm-up and stayed flat."""
    problems = []
    if not check.get("ok"):
        problems.append("DBO differed from plain at the start (" + check.get("why", "") + ")")
    if stopped is not None:
        problems.append(f"stopped: {stopped}")
    if summary["errors"]:
        problems.append(f"{summary['errors']} of {summary['calls']} calls failed")
    mem = summary["memory"]
    if judge_memory and mem["flat"] is None:
        problems.append("no memory figures after the warm-up (run longer, or fewer --warmup-calls)")
    elif judge_memory and not mem["flat"]:
        worst = {k: mem[k]["worst_spread"] for k in ("allocated", "reserved")}
        problems.append("memory not flat after the warm-up: (max - min) / max " + ", ".join(
            f"{k} {v:.2%}" for k, v in worst.items()) + f" (want <= {mem['tolerance']:.0%})")
    if problems:
        return False, "; ".join(problems)
    flat = "" if mem["flat"] is None else (
        f", memory flat after the warm-up (allocated within {mem['allocated']['worst_spread']:.3%}, "
        f"reserved within {mem['reserved']['worst_spread']:.3%})")
    return True, f"{summary['calls']} calls, no error, DBO matched plain at the start{flat}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_summary(summary: dict, check: dict, *, seconds: float, warmup_calls: int, label: str) -> str:
    """The summary rank 0 prints: calls and errors, the start's check, memory after the warm-up
    per rank, tokens/s first and last per kind, host RSS."""
    kinds = ", ".join(f"{n} {k}" for k, n in summary["per_kind"].items())
    lines = [f"soak: {summary['calls']} calls ({kinds}) in {seconds:.0f} s, errors: {summary['errors']}; "
             f"{label}",
             f"DBO against plain at the start: {'ok' if check.get('ok') else 'FAILED'} "
             f"({check.get('why', '')})",
             "",
             f"| after each call, from call {warmup_calls} on ({summary['measured_calls']} calls) | rank | "
             "min GiB | max GiB | (max-min)/max | flat (<= 1%) |",
             "|---|---|---|---|---|---|"]
    if summary["memory"]["flat"] is None:
        lines.append("| memory allocated, reserved | - | - | - | - | none measured after the warm-up "
                     "(CUDA only) |")
    else:
        for key in ("allocated", "reserved"):
            for r, f in enumerate(summary["memory"][key]["per_rank"]):
                spread = "-" if f["spread"] is None else f"{f['spread']:.3%}"
                flat = {True: "yes", False: "NO", None: "-"}[f["flat"]]
                lines.append(f"| memory {key} | {r} | {_gib(f['min'])} | {_gib(f['max'])} | {spread} "
                             f"| {flat} |")
    for r, rss in enumerate(summary["rss_mib"]):
        if rss is not None:
            lines.append(f"| host RSS (MiB, after warm-up -> end) | {r} | {rss['after_warmup']:.0f} | "
                         f"{rss['end']:.0f} | - | (not judged) |")
    lines += ["", "| tokens/s per rank over a window of calls (tokens / seconds) | first | last | window "
                  "| calls |", "|---|---|---|---|---|"]
    what = {"prefill": "prefill (prompt tokens/s)", "generate": "generate (new tokens/s, prefill included)"}
    for k, t in summary["tokens_s"].items():
        lines.append(f"| {what[k]} | {_rate(t['first'])} | {_rate(t['last'])} | {t['window']} "
                     f"| {t['calls']} |")
    return "\n".join(lines)
