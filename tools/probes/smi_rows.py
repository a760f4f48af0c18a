"""The GPU's SM clock, board power and temperature during each row of an experts grid, from the
two files ``tests/gpu/run.sh grid`` writes with ``SMI=1`` (anywhere: no GPU needed).

    python3 tools/probes/smi_rows.py OUT/grid_log.txt OUT/smi_grid.csv

``grid_log.txt``: the grid's lines, each behind the epoch time it was printed at (the
benchmark prints a row's line when its timings are done, so a row's window runs from the
previous line to its own; the window holds the row's set-up and its ``from idle`` timings too,
not only the GPU-time calls). ``smi_grid.csv``: ``nvidia-smi --query-gpu=timestamp,clocks.sm,
clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_event_reasons.active --format=
csv,noheader -lms 100`` (its timestamps are the machine's local time, read as UTC, as that
machine keeps it). Per row it prints the samples' count and the medians of the SM clock, the
power and the GPU temperature, and their mean over the grid: what to hold side by side for
two GPUs of one kind whose grids differ (docs/performance.md).
"""

from __future__ import annotations

import datetime
import re
import statistics
import sys
from pathlib import Path

ROW = re.compile(r"^(\d+\.\d+) (limit =|H=\d+ I=(\d+) L=(\d+) T=(\d+):)")


def read_smi(path: str, utc: bool = True) -> list[tuple[float, list[str]]]:
    """``(epoch s, the other columns)`` of each line of an ``nvidia-smi --query-gpu=timestamp,...
    --format=csv,noheader`` log whose timestamp parses. ``utc``: its local time read as UTC (the
    GPU host's zone, for a log read on another machine); else in this machine's zone (a log
    written here, against ``time.time()``)."""
    out = []
    for line in Path(path).read_text().splitlines():
        p = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            continue
        out.append(((t.replace(tzinfo=datetime.timezone.utc) if utc else t).timestamp(), p[1:]))
    return out


def samples(path: str) -> list[tuple[float, float, float, float]]:
    """``(epoch s, SM MHz, watts, GPU degrees C)`` of each parsable line of the grid's CSV."""
    out = []
    for t, p in read_smi(path):
        try:
            out.append((t, *(float(p[i].split()[0]) for i in (0, 2, 3))))
        except (ValueError, IndexError):
            continue
    return out


def windows(path: str) -> list[tuple[tuple[int, int, int], float, float]]:
    """``((I, local experts, tokens), start, end)`` of each row of the timestamped grid log."""
    rows, prev = [], None
    for line in Path(path).read_text().splitlines():
        m = ROW.match(line)
        if not m:
            continue
        t = float(m.group(1))
        if m.group(3) is not None and prev is not None:
            rows.append(((int(m.group(3)), int(m.group(4)), int(m.group(5))), prev, t))
        prev = t
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    smi, rows = samples(argv[1]), windows(argv[0])
    if not smi or not rows:
        print(f"nothing to read: {len(rows)} timestamped rows, {len(smi)} samples", file=sys.stderr)
        return 1
    sums = []
    print(f"{'I':>5} {'L':>4} {'T':>6} {'n':>4} {'SM MHz':>7} {'W':>5} {'C':>4}")
    for (i, n, t), a, b in rows:
        s = [x for x in smi if a <= x[0] < b]
        if not s:
            print(f"{i:>5} {n:>4} {t:>6}    0 (no samples in its window)")
            continue
        med = [statistics.median(x[k] for x in s) for k in (1, 2, 3)]
        sums.append(med)
        print(f"{i:>5} {n:>4} {t:>6} {len(s):>4} {med[0]:>7.0f} {med[1]:>5.0f} {med[2]:>4.0f}")
    mean = [statistics.fmean(m[k] for m in sums) for k in range(3)]
    print(f"mean of the rows' medians: SM {mean[0]:.0f} MHz, {mean[1]:.0f} W, {mean[2]:.1f} C "
          f"over {len(sums)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
