"""The best overlapped step against the best serial step of ANY backend, from several overlap
bundles of one run (``python -m dbo.bench overlap --out DIR`` per backend).

    python -m dbo.bench compare DIR_OR_JSON [DIR_OR_JSON ...] [--json OUT]

Per shape (tokens, intermediate): the fastest serial step over the bundles (and its backend),
the fastest DBO step over the bundles and schedules (split or merged; backend/schedule), and
the speedup, best serial time over best DBO time (above 1 means overlap pays over the best plain
choice), with each backend's comm time. A bundle made under ``DBO_DISABLE=1`` timed the plain
forward in its DBO rows: they are left out of the best DBO, and the table and the verdict say
so. Compare only bundles of one run on one machine. A file
that is not an overlap bundle, or a path that is not there, is bad input (one line, exit code
2); a directory that holds no bundle is skipped with a line that says so, and the verdict is
FAIL when no bundle was left.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dbo.bench.cli import ArgumentParser, check_writable_file, legend, verdict
from dbo.files import write_whole

__all__ = ["load_bundle", "label", "dbo_disabled", "compare_bundles", "format_comparison", "main"]

_DBO_SCHEDULES = (("split", "dbo_ms"), ("merged", "merged_ms"))
PROG = "python -m dbo.bench compare"


def load_bundle(path: str | Path) -> dict:
    """Read an overlap bundle: a ``bench_overlap.json`` or the directory that holds one."""
    p = Path(path)
    if p.is_dir():
        p = p / "bench_overlap.json"
    if not p.exists():
        raise FileNotFoundError(f"no overlap bundle at {p}")
    try:
        bundle = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p} is not an overlap bundle (not JSON: {exc})") from None
    schema = bundle.get("schema") if isinstance(bundle, dict) else None
    if not str(schema or "").startswith("dbo.bench_overlap/"):
        raise ValueError(f"{p} is not an overlap bundle (schema {schema!r})")
    return bundle


def label(bundle: dict) -> str:
    """The backend's name, with its ``--backend-opt`` options if any: ``copy_engine[put_order=rank]``."""
    opts = bundle["args"].get("backend_opt") or []
    return bundle["args"]["backend"] + (f"[{','.join(opts)}]" if opts else "")


def dbo_disabled(bundle: dict) -> bool:
    """Whether ``bundle`` was made under ``DBO_DISABLE=1`` (its DBO rows timed the plain forward)."""
    return bool((bundle.get("env") or {}).get("dbo_disabled"))


def compare_bundles(bundles: list[dict]) -> list[dict[str, Any]]:
    """One row per (tokens, intermediate) seen in any bundle, sorted; ``None`` where no bundle
    measured that part. Each row: ``tokens``, ``intermediate``, ``serial_ms``/``serial_backend``,
    ``dbo_ms``/``dbo_choice`` (``backend/schedule``), ``speedup`` (serial / DBO) and
    ``comm_ms`` (backend -> ms per layer). A bundle made under ``DBO_DISABLE=1``
    (:func:`dbo_disabled`) gives its serial and comm times only."""
    if not bundles:
        raise ValueError("compare_bundles needs at least one bundle")
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for bundle in bundles:
        backend = label(bundle)
        for shape in bundle["shapes"]:
            s = shape.get("summary") or {}
            key = (int(shape["tokens"]), int(shape["intermediate"]))
            row = rows.setdefault(key, {"tokens": key[0], "intermediate": key[1], "serial_ms": None,
                                        "serial_backend": None, "dbo_ms": None, "dbo_choice": None,
                                        "speedup": None, "comm_ms": {}})
            if s.get("comm_ms") is not None:
                row["comm_ms"][backend] = s["comm_ms"]
            t = s.get("serial_ms")
            if t is not None and (row["serial_ms"] is None or t < row["serial_ms"]):
                row["serial_ms"], row["serial_backend"] = t, backend
            for schedule, field in () if dbo_disabled(bundle) else _DBO_SCHEDULES:
                t = s.get(field)
                if t is not None and (row["dbo_ms"] is None or t < row["dbo_ms"]):
                    row["dbo_ms"], row["dbo_choice"] = t, f"{backend}/{schedule}"
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        if row["serial_ms"] is not None and row["dbo_ms"]:
            row["speedup"] = row["serial_ms"] / row["dbo_ms"]
    return out


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`compare_bundles`'s rows."""
    backends = sorted({b for r in rows for b in r["comm_ms"]})
    head = ["T", "I", *(f"{b} comm" for b in backends), "best serial (backend)",
            "best DBO (backend/schedule)", "speedup (best serial / best DBO)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["tokens"]), str(r["intermediate"]), *(_f(r["comm_ms"].get(b)) for b in backends),
                 f"{_f(r['serial_ms'])} ({r['serial_backend'] or '-'})",
                 f"{_f(r['dbo_ms'])} ({r['dbo_choice'] or '-'})",
                 "-" if r["speedup"] is None else f"{r['speedup']:.3f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += legend({"T": "tokens per rank", "I": "each expert's intermediate size",
                     "BACKEND comm": "that backend's all-to-all alone",
                     "best serial": "the fastest serial step of any backend",
                     "best DBO": "the fastest overlapped step of any backend and schedule (split, merged)",
                     "speedup": "best serial / best DBO (above 1: DBO pays)"})
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", help="overlap bundles (bench_overlap.json or its directory)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    missing = [p for p in args.bundles if not Path(p).exists()]
    if missing:
        ap.error(f"no such file or directory: {', '.join(missing)} (a bench_overlap.json or the "
                 "directory holding it)")
    if args.json:
        check_writable_file(ap, "--json", args.json)
    bundles = []
    for path in args.bundles:
        try:
            bundles.append(load_bundle(path))
        except ValueError as exc:  # a file that is not a bundle: the caller named the wrong one
            ap.error(f"{exc}; want a bench_overlap.json or the directory holding it")
        except OSError as exc:  # a directory without a bundle (a run that ended early)
            print(f"skipped: {exc}")
    if not bundles:
        return verdict(PROG, False, f"no overlap bundle in {', '.join(args.bundles)}")
    for b in bundles:
        for inter, tuned in (b.get("autotune") or {}).items():
            print(f"{label(b)} I={inter}: autotune chose {tuned.get('schedule')}")
    rows = compare_bundles(bundles)
    off = [label(b) for b in bundles if dbo_disabled(b)]
    off_why = (f"DBO_DISABLE=1 when {', '.join(off)} ran: DBO was disabled there, its DBO rows timed "
               "the plain forward and are left out of the best DBO" if off else "")
    if off:
        print(off_why)
    print("per layer, ms (one run; compare bundles of one run only)")
    print(format_comparison(rows))
    if args.json:
        write_whole(args.json, json.dumps({"rows": rows}, indent=1))
    both = [r for r in rows if r["speedup"] is not None]
    off_why += "; " if off else ""
    if not both:
        return verdict(PROG, False, f"{off_why}{len(bundles)} bundle(s), but no shape has both a "
                                    "serial and a DBO time")
    best = max(both, key=lambda r: r["speedup"])
    wins = sum(r["speedup"] > 1 for r in both)
    return verdict(PROG, True, f"{off_why}{len(bundles)} bundle(s), {len(both)} shape(s) compared: the best "
                               f"DBO beats the best serial at {wins} of them (best {best['speedup']:.3f}x "
                               f"at T={best['tokens']} I={best['intermediate']}, {best['dbo_choice']})")
