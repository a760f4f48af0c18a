"""Reads the overlap benchmark's bundles of emulated ranks (``tests/gpu/run.sh emulated`` writes
``decode_epN/`` and ``prefill_epN/``) and prints, per EP size and token count: plain, the best
overlapped schedule over plain (CUDA-graph rows where there are, else eager), its efficiency
(plain - best) / min(compute, comm), the bound plain / max(compute, comm), the untuned wrapper
over plain, and the comm share.

    python tools/probes/emulated_grid.py DIR [DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEDULES = ("dbo", "merged", "sbo", "sbo_dbo")


def rows(bundle: dict) -> list[dict]:
    args = bundle["args"]
    out = []
    for sh in bundle["shapes"]:
        s, g = sh.get("summary", {}), sh.get("cuda_graph") or {}
        graph = bool(g.get("ok"))
        plain = g.get("graph_serial_ms") if graph else s.get("serial_ms")
        times = {m: (g.get(f"graph_{m}_ms") if graph else s.get(f"{m}_ms")) for m in SCHEDULES}
        times = {m: t for m, t in times.items() if t}
        best = min(times, key=times.get) if times else None
        compute, comm = s.get("compute_ms"), s.get("comm_ms")
        row = {"ep": args.get("emulate_ep"), "layout": args.get("layout"), "tokens": sh["tokens"],
               "intermediate": sh["intermediate"], "graph": graph, "plain_ms": plain,
               "best": best, "best_ms": times.get(best), "compute_ms": compute, "comm_ms": comm,
               "untuned_wrapper_vs_plain": s.get("untuned_wrapper_vs_serial")}
        if plain and best:
            row["best_over_plain"] = plain / times[best]
            if compute and comm:
                row["efficiency"] = (plain - times[best]) / min(compute, comm)
                row["bound"] = plain / max(compute, comm)
                row["comm_share"] = comm / (compute + comm)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    dirs = (sys.argv[1:] if argv is None else argv)
    if not dirs:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    table = []
    for d in dirs:
        for f in sorted(Path(d).rglob("bench_overlap.json")):
            table.extend(rows(json.loads(f.read_text())))
    print(f"{'EP':>4} {'layout':>9} {'T':>6} {'I':>5} {'graph':>5} {'plain ms':>9} {'best':>8} "
          f"{'x plain':>7} {'eff':>5} {'bound':>6} {'comm%':>5} {'wrap':>5}")
    for r in sorted(table, key=lambda r: (r["layout"] or "", r["ep"] or 0, r["intermediate"], r["tokens"])):
        def f(k, fmt=".3f", r=r):
            v = r.get(k)
            return "-" if v is None else format(v, fmt)
        print(f"{r['ep'] or '-':>4} {r['layout'] or '-':>9} {r['tokens']:>6} {r['intermediate']:>5} "
              f"{'yes' if r['graph'] else 'no':>5} {f('plain_ms'):>9} {r['best'] or '-':>8} "
              f"{f('best_over_plain'):>7} {f('efficiency', '.2f'):>5} {f('bound'):>6} "
              f"{f('comm_share', '.2f'):>5} {f('untuned_wrapper_vs_plain'):>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
