"""``python -m dbo.bench switch`` on the CPU: it runs, prints its table and a verdict on its
targets, and writes the figures."""

from __future__ import annotations

import json

from dbo.testing.launch import run_entry


def test_switch_bench_command(tmp_path):
    out = tmp_path / "switch.json"
    proc = run_entry(["-m", "dbo.bench", "switch", "--switches", "2000", "--thread-switches", "200",
                      "--repeats", "2", "--json", str(out)], timeout=120)
    # the verdict holds the targets (a loaded machine may miss them): its exit code says which
    last = proc.stdout.strip().splitlines()[-1]
    verdict = last.split(": ")[1]
    assert (verdict, proc.returncode) in (("PASS", 0), ("FAIL", 1)), proc.stdout + proc.stderr
    assert last.startswith("python -m dbo.bench switch: ") and "targets: <= 1.5 us, >= 5x" in last
    assert "dbo greenlet (dbo_yield)" in proc.stdout and "cheaper per switch" in proc.stdout
    assert "\n  min, median: over 2 repeats, microseconds per switch; " in proc.stdout  # the columns
    res = json.loads(out.read_text())
    assert res["device"] == "cpu"
    assert 0 < res["dbo_us_min"] <= res["dbo_us_median"]
    assert res["ratio_median"] == res["threads_us_median"] / res["dbo_us_median"]
