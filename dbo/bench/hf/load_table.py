"""``hf-load``'s results (:mod:`dbo.bench.hf.load`): the run's record (:class:`LoadResult`, its
:class:`LoadRow` list, the ``--json`` file), the table and lines printed from it, and the verdict.

A row is one rank of one mode: ``mode`` (``plain`` or ``ep``), ``rank``, its RSS after imports,
its peak RSS after loading and after the first prefill and its RSS after loading (MiB), the
load's wall time (``load_s``), the bytes of routed experts it holds, and the prefill's time
(``prefill_s``; ``ep``: the overlapped prefill's). An ``ep`` row also has the first prefill's time
and the bytes it all-gathered, the layers that went through dbo, and the bytes the overlapped
prefill all-gathered; with ``--check``, its logits against the plain model's (``rel_err_vs_plain``,
``top1_agree``, ``logits_match``). A figure the row does not have is None and left out of its
JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dbo.bench.cli import legend
from dbo.bench.hf.options import LoadOptions
from dbo.files import write_whole

__all__ = ["LoadRow", "LoadResult", "print_table", "verdict_reason", "write_json"]


@dataclass(frozen=True, kw_only=True)
class LoadRow:
    """One rank of one mode (see the module docstring); the fields in the order of its JSON."""

    mode: str
    rank: int
    rss_after_imports_mib: float
    load_s: float
    peak_rss_after_load_mib: float
    rss_after_load_mib: float
    expert_bytes: int
    first_forward_s: float | None = None
    first_forward_gathered_bytes: int | None = None
    layers_through_dbo: int | None = None
    dbo_gathered_bytes: int | None = None
    prefill_s: float
    peak_rss_after_prefill_mib: float
    rel_err_vs_plain: float | None = None
    top1_agree: float | None = None
    logits_match: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LoadRow:
        return cls(**d)


@dataclass
class LoadResult:
    """A run: the checkpoint's ``size_gb`` (its safetensors, GB), ``ranks`` processes per mode,
    the ``ep`` mode's ``backend``, and every rank's row of both modes. ``to_json`` is the
    ``--json`` file; ``from_json`` reads one back."""

    size_gb: float
    ranks: int
    backend: str
    rows: list[LoadRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"size_gb": self.size_gb, "ranks": self.ranks, "backend": self.backend,
                "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LoadResult:
        return cls(**{**d, "rows": [LoadRow.from_json(r) for r in d.get("rows", ())]})


def _rows(rows: Iterable[LoadRow | Mapping[str, Any]]) -> list[LoadRow]:
    return [r if isinstance(r, LoadRow) else LoadRow.from_json(r) for r in rows]


def print_table(result: LoadResult, args: LoadOptions) -> None:
    """Print the header line, the markdown table of ``result``'s rows with its legend, and each
    ``ep`` rank's first prefill and (``--check``) its logits against the plain model's."""
    print(f"\n{args.dir}: {result.size_gb:.2f} GB of bf16 safetensors, {result.ranks} gloo ranks on CPU, "
          f"backend {result.backend}; prefill of {args.batch}x{args.seq} tokens per rank\n")
    print("| mode | rank | load s | RSS after imports MiB | peak RSS after load MiB | peak RSS after "
          "prefill MiB | routed-expert bytes held GB | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result.rows:
        print(f"| {r.mode} | {r.rank} | {r.load_s:.1f} | {r.rss_after_imports_mib:.0f} | "
              f"{r.peak_rss_after_load_mib:.0f} | {r.peak_rss_after_prefill_mib:.0f} | "
              f"{r.expert_bytes / 1e9:.2f} | {r.prefill_s:.2f} |")
    print("\n".join(legend({"mode": "plain: the whole model on every rank; ep: loaded expert-parallel, "
                                     "each rank its share of the routed experts",
                             "RSS": "the rank's resident memory", "peak RSS": "its highest so far",
                             "prefill s": "one prefill (ep: through DBOPrefill)"})))
    for r in result.rows:
        if r.first_forward_gathered_bytes is not None:
            print(f"rank {r.rank}: the first prefill as loaded all-gathered "
                  f"{r.first_forward_gathered_bytes / 1e9:.2f} GB (the dense weights, kept whole) and "
                  f"took {r.first_forward_s:.2f} s; then DBOPrefill {r.prefill_s:.2f} s, "
                  f"{r.dbo_gathered_bytes / 1e9:.2f} GB gathered")
        if r.rel_err_vs_plain is not None:
            print(f"rank {r.rank}: DBO logits vs plain model rel err {r.rel_err_vs_plain:.1e}, "
                  f"top-1 agreement {r.top1_agree:.2f}")


def verdict_reason(rows: Iterable[LoadRow | Mapping[str, Any]], args: LoadOptions) -> tuple[bool, str]:
    """(passed, why) for the run's last line: every ``ep`` row of ``rows`` (records, or their
    JSON) holds 1/``args.ranks`` of the plain model's routed experts, its overlapped prefill
    gathered nothing and (``--check``) its logits match the plain model's."""
    rows = _rows(rows)
    plain = [r for r in rows if r.mode == "plain"]
    ep = [r for r in rows if r.mode == "ep"]
    share = plain[0].expert_bytes // args.ranks
    problems = [f"ep rank {r.rank} holds {r.expert_bytes:,} bytes of experts, not {share:,}"
                for r in ep if r.expert_bytes != share]
    problems += [f"ep rank {r.rank}'s DBOPrefill all-gathered {r.dbo_gathered_bytes:,} bytes"
                 for r in ep if r.dbo_gathered_bytes]
    problems += [f"ep rank {r.rank}'s logits differ from the plain model's (rel err "
                 f"{r.rel_err_vs_plain:.1e}, top-1 agree {r.top1_agree:.2f})"
                 for r in ep if r.logits_match is False]
    wrote = f"; wrote {args.json}" if args.json else ""
    if problems:
        return False, "; ".join(problems) + wrote
    checked = "; DBO logits match the plain model's" if args.check else ""
    return True, (f"every ep rank holds 1/{args.ranks} of the routed experts and its DBOPrefill "
                  f"gathered nothing{checked}{wrote}")


def write_json(result: LoadResult, path: str | None) -> None:
    """Write ``result`` to ``path`` (``--json``; None: nothing)."""
    if path:
        write_whole(path, json.dumps(result.to_json(), indent=1))
