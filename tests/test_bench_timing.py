"""``dbo.bench.timing.median_ms``: the one per-rank median timer of the benchmarks and examples."""

from __future__ import annotations

import time

import pytest

from dbo.bench.timing import median_ms


def test_median_ms_calls_warmup_then_steps_and_reports_the_median():
    calls = []

    def fn() -> None:
        calls.append(None)
        time.sleep(0.05 if len(calls) == 3 else 0.002)  # one slow step: the median ignores it

    ms = median_ms(fn, steps=5, warmup=2)
    assert len(calls) == 7
    assert 1.5 <= ms <= 20.0  # 2 ms sleeps, with 10x slack for a loaded machine


def test_median_ms_rejects_bad_counts():
    with pytest.raises(ValueError, match="steps >= 1.*steps=0"):
        median_ms(lambda: None, steps=0)
    with pytest.raises(ValueError, match="warmup >= 0.*warmup=-1"):
        median_ms(lambda: None, steps=1, warmup=-1)
