"""``hf-prefill``'s results: the check of one row, the markdown table, the JSON file and the
verdict line.

A row is a dict: ``backend`` (its label), ``batch``, ``seq``, ``plain_ms``, ``dbo_ms`` (None for
a row without DBO), ``rel_err`` and ``top1_agree`` (DBO against plain; the unconverted model
against the converted one), ``ok`` (None: not checked), ``split`` (the plan), and where measured
``expert_schedule``, ``autotune``, ``plain_peak_gib`` / ``dbo_peak_gib`` (CUDA only) and
``rel_vs_a2a`` (against transformers' own all_to_all model). Times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from dbo.files import write_whole

__all__ = ["logits_match", "print_table", "write_json", "verdict_reason"]


def logits_match(rel_err: float, top1_agree: float, dtype: torch.dtype) -> bool:
    """Whether logits with this relative error and top-1 agreement count as equal: float32 at a
    relative error of at most 1e-4; bfloat16 at most 0.1 or with at least 75% of the top tokens
    agreeing. (bf16: the ubatches' matmuls round differently from the whole batch's, and a one-ulp
    change can flip a near-tie in a later layer's routing, so with many layers of random weights a
    few sequences differ; a wrong split or merge gives an error near 1 and next to no agreement.)"""
    if dtype == torch.float32:
        return rel_err <= 1e-4
    return rel_err <= 0.1 or top1_agree >= 0.75


def _header(args: argparse.Namespace, config: Any, world: int, build_s: float, device: torch.device) -> str:
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    what = f"{args.checkpoint} (loaded expert-parallel)" if args.checkpoint else args.preset
    per = "GPU" if cuda else "rank"
    link = "" if args.link is None else "; " + args.link.describe()
    dtype = str(args.dtype).removeprefix("torch.")
    return (f"{what}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {dtype}, "
            f"{world} x {name}; rank 0 {'loaded' if args.checkpoint else 'built'} its model in "
            f"{build_s:.1f} s; median of {args.steps} steps, slowest rank; tokens/s per {per} = "
            f"batch*seq / time{link}")


def print_table(args: argparse.Namespace, config: Any, world: int, build_s: float, rows: list[dict],
                device: torch.device, dbo_disabled: bool = False) -> None:
    """Print the header line and the markdown table of ``rows`` (rank 0 calls it). Peak memory
    is a column on CUDA only; the footnote on the unconverted model only where it ran.
    ``dbo_disabled`` (``DBO_DISABLE`` was set): the DBO rows ran the plain forward; a line above
    the table says so and their speedups read ``off``."""
    cuda = device.type == "cuda"
    per = "GPU" if cuda else "rank"
    anchor = any(r.get("rel_vs_a2a") is not None for r in rows)
    cols = ["backend", "batch x seq", "plain ms", "DBO ms", f"plain tok/s per {per}",
            f"DBO tok/s per {per}", "DBO speedup", "rel err", "top-1 agree"]
    cols += ["peak GiB plain / DBO"] if cuda else []
    cols += ["rel vs a2a"] if anchor else []
    print("\n" + _header(args, config, world, build_s, device) + "\n")
    if dbo_disabled:
        print("DBO_DISABLE=1: DBO was disabled in this run; the DBO columns timed the plain forward "
              "and their speedups read 'off'\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        if r["plain_ms"] is None:  # a row that could not run says why in its split column
            print(f"| {r['backend']} | - | {r['split']} |" + " |" * (len(cols) - 3))
            continue
        tokens = r["batch"] * r["seq"]
        dbo = r["dbo_ms"]
        cells = [r["backend"], f"{r['batch']} x {r['seq']}", f"{r['plain_ms']:.1f}",
                 "" if dbo is None else f"{dbo:.1f}", f"{tokens / r['plain_ms'] * 1e3:,.0f}",
                 "" if dbo is None else f"{tokens / dbo * 1e3:,.0f}",
                 "" if dbo is None else "off" if dbo_disabled else f"{r['plain_ms'] / dbo:.2f}x",
                 f"{r['rel_err']:.1e}" + ("" if r["ok"] in (None, True) else " MISMATCH"),
                 f"{r['top1_agree']:.2f}"]
        if cuda:
            plain_peak, dbo_peak = r.get("plain_peak_gib"), r.get("dbo_peak_gib")
            cells.append("-" if plain_peak is None else
                         f"{plain_peak:.1f} / {'-' if dbo_peak is None else f'{dbo_peak:.1f}'}")
        if anchor:
            cells.append("-" if r.get("rel_vs_a2a") is None else f"{r['rel_vs_a2a']:.1e}")
        print("| " + " | ".join(cells) + " |")
    if any(r["backend"] == "unconverted" for r in rows):
        print("\n(unconverted: the original model, every expert on every rank, no communication; its "
              "rel err / agreement are against the converted model's plain logits)")


def write_json(args: argparse.Namespace, config: Any, world: int, device: torch.device,
               rows: list[dict], dbo_disabled: bool = False) -> None:
    """Write the rows so far to ``--json`` (call it on rank 0; a later failure keeps them);
    ``dbo_disabled``: ``DBO_DISABLE`` was set (the DBO rows ran the plain forward)."""
    if not args.json:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    write_whole(args.json, json.dumps(dict(
        preset=args.preset, checkpoint=args.checkpoint, layers=config.num_hidden_layers, world=world,
        device=name, dtype=str(args.dtype), steps=args.steps, dbo_disabled=dbo_disabled, rows=rows),
        indent=1))


def verdict_reason(rows: list[dict], json_path: str | None,
                   dbo_disabled: bool = False) -> tuple[bool, str]:
    """(passed, why) for the run's last line: every checked row's logits matched.
    ``dbo_disabled``: ``DBO_DISABLE`` was set, which the line then says first."""
    dbo_rows = [r for r in rows if r["dbo_ms"] is not None]
    other = [r for r in rows if r["dbo_ms"] is None and r["ok"] is not None]
    bad = [r for r in rows if r["ok"] is False]
    wrote = f"; wrote {json_path}" if json_path else ""
    if bad:
        names = ", ".join(f"{r['backend']} {r['batch']}x{r['seq']} (rel err {r['rel_err']:.1e}, top-1 "
                          f"agree {r['top1_agree']:.2f})" for r in bad)
        return False, f"logits differ on {len(bad)} of {len(dbo_rows) + len(other)} rows: {names}{wrote}"
    err = max(r["rel_err"] for r in dbo_rows)
    why = (f"DBO_DISABLE=1: DBO was disabled, every DBO row ran the plain forward (max rel err "
           f"{err:.1e} against plain)" if dbo_disabled else
           f"DBO matches plain on every row (max rel err {err:.1e})")
    if other:
        why += (f"; the unconverted model matches the converted one (max rel err "
                f"{max(r['rel_err'] for r in other):.1e})")
    return True, why + wrote
