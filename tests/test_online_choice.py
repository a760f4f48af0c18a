"""dbo.split.online: an untuned wrapper measures plain against overlapped per size bucket and
keeps the faster, on one rank with an injected clock and on a gloo group of 2 ranks."""

from __future__ import annotations

import logging

import pytest

from dbo.expert_schedule import ExpertSchedule
from dbo.split import SplitConfig, SplitReason, UBatchPlan
from dbo.split.online import OnlineChoice, size_bucket
from dbo.testing.dist import DistWorld

PLAIN, SPLIT, MERGED, SBO = (ExpertSchedule.PLAIN, ExpertSchedule.SPLIT, ExpertSchedule.MERGED,
                             ExpertSchedule.SBO)


def _plan(tokens: int) -> UBatchPlan:
    half = tokens // 2
    return UBatchPlan(tokens, ((0, half), (half, tokens)), tokens - half, SplitReason.SPLIT)


class FakeRun:
    """A forward whose cost per candidate is set by the test: it advances an injected clock."""

    def __init__(self, costs_ms: dict[ExpertSchedule, float]):
        self.costs_ms = dict(costs_ms)
        self.now = 0.0
        self.ran: list[ExpertSchedule] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, schedule: ExpertSchedule) -> str:
        self.ran.append(schedule)
        self.now += self.costs_ms[schedule] / 1e3
        return schedule.value


def _drive(choice: OnlineChoice, run: FakeRun, plan: UBatchPlan, calls: int) -> list[str]:
    return [choice.run(plan, run) for _ in range(calls)]


def test_it_keeps_the_fastest_candidate_after_measuring_each():
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0, MERGED: 9.0, SBO: 9.5})
    choice = OnlineChoice(trials=3, clock=run.clock)
    plan = _plan(4096)
    outs = _drive(choice, run, plan, choice.calls_to_decide)
    # the measuring calls run each candidate (every schedule by default) in a block: a warm-up
    # call, then `trials` timed calls, so each is timed as it runs when chosen
    assert run.ran == [PLAIN] * 4 + [SPLIT] * 4 + [MERGED] * 4 + [SBO] * 4
    assert outs == [c.value for c in run.ran]
    assert choice.choice(plan) is SPLIT
    run.ran.clear()
    _drive(choice, run, plan, 5)
    assert run.ran == [SPLIT] * 5
    bucket = choice.buckets[size_bucket(plan)]
    assert bucket.medians_ms == pytest.approx({PLAIN: 10.0, SPLIT: 8.0, MERGED: 9.0, SBO: 9.5})
    assert "split" in choice.table()


def test_an_overlapped_schedule_within_the_margin_loses_to_plain():
    run = FakeRun({PLAIN: 10.0, SPLIT: 9.9, MERGED: 12.0, SBO: 10.1})  # 1%: noise, not a win
    choice = OnlineChoice(margin=0.02, clock=run.clock)
    plan = _plan(1024)
    _drive(choice, run, plan, choice.calls_to_decide)
    assert choice.choice(plan) is PLAIN
    run.ran.clear()
    _drive(choice, run, plan, 3)
    assert run.ran == [PLAIN] * 3


def test_the_warm_up_round_is_not_counted():
    costs = {PLAIN: 10.0, SPLIT: 8.0}
    run = FakeRun(costs)
    choice = OnlineChoice((PLAIN, SPLIT), trials=2, clock=run.clock)
    plan = _plan(2048)
    _drive(choice, run, plan, 3)  # plain's block: its warm-up and two timed calls
    run.costs_ms[SPLIT] = 1000.0  # split's slow first call (compilation) must not decide
    choice.run(plan, run)
    run.costs_ms[SPLIT] = 8.0
    _drive(choice, run, plan, choice.calls_to_decide - 4)
    assert run.ran == [PLAIN] * 3 + [SPLIT] * 3
    assert choice.choice(plan) is SPLIT


def test_buckets_decide_independently():
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0})
    choice = OnlineChoice((PLAIN, SPLIT), clock=run.clock)
    small, large = _plan(600), _plan(5000)
    assert size_bucket(small) == 1024 and size_bucket(large) == 8192
    _drive(choice, run, large, choice.calls_to_decide)
    run.costs_ms[SPLIT] = 20.0
    _drive(choice, run, small, choice.calls_to_decide)
    assert choice.choice(large) is SPLIT
    assert choice.choice(small) is PLAIN


def test_a_choice_that_stops_paying_is_measured_again():
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0})
    choice = OnlineChoice((PLAIN, SPLIT), trials=1, recheck_calls=4, clock=run.clock)
    plan = _plan(4096)
    _drive(choice, run, plan, choice.calls_to_decide)
    assert choice.choice(plan) is SPLIT
    run.costs_ms[SPLIT] = 15.0  # the overlap stops paying
    _drive(choice, run, plan, 4)  # still on its choice until the recheck
    assert choice.choice(plan) is SPLIT
    _drive(choice, run, plan, choice.calls_to_decide)
    assert choice.choice(plan) is PLAIN
    assert choice.buckets[size_bucket(plan)].decisions == 2


@pytest.mark.parametrize("kwargs", [
    dict(candidates=("split", "merged")),
    dict(candidates=("plain",)),
    dict(candidates=("plain", "bogus")),
    dict(trials=0),
    dict(trials=True),
    dict(margin=1.0),
    dict(recheck_calls=0),
])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        OnlineChoice(**kwargs)


def test_adaptive_is_part_of_the_agreement():
    assert SplitConfig().adaptive
    assert SplitConfig(adaptive=False).agreement_key() != SplitConfig().agreement_key()


def _two_rank_job(slow_rank_split_ms: float) -> tuple[str, dict[str, float], list[str]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    # rank 1's overlapped calls are slow: the slowest rank's timings must decide for both
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0 if rank == 0 else slow_rank_split_ms})
    choice = OnlineChoice((PLAIN, SPLIT), trials=2, clock=run.clock)
    plan = _plan(4096)
    _drive(choice, run, plan, choice.calls_to_decide)
    run.ran.clear()
    _drive(choice, run, plan, 2)
    medians = choice.buckets[size_bucket(plan)].medians_ms
    return choice.choice(plan).value, {k.value: v for k, v in medians.items()}, [c.value for c in run.ran]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_ranks_agree_on_the_slowest_rank_timings():
    with DistWorld(2) as world:
        slow, fast = world.run(_two_rank_job, 12.0), world.run(_two_rank_job, 8.5)
    assert [r[0] for r in slow] == ["plain", "plain"]
    assert slow[0][1] == slow[1][1] == pytest.approx({"plain": 10.0, "split": 12.0})
    assert [r[2] for r in slow] == [["plain", "plain"]] * 2
    assert [r[0] for r in fast] == ["split", "split"]


def test_a_measuring_bucket_says_which_call_it_is_on_and_shows_its_timings_so_far():
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0})
    choice = OnlineChoice((PLAIN, SPLIT), trials=2, clock=run.clock)
    plan = _plan(4096)
    assert choice.progress(plan) is None and choice.table() == ""
    choice.run(plan, run)
    assert choice.progress(plan) == "measuring ~4096 tokens: call 1 of 6, plain (warm-up)"
    assert "no timed call yet" in choice.table()
    _drive(choice, run, plan, 3)  # plain's two timed calls, then split's warm-up
    assert choice.progress(plan) == "measuring ~4096 tokens: call 4 of 6, split (warm-up)"
    assert choice.table() == ("~4096 tokens: plain 10.000 ms (2 of 2 timed) "
                              "-> measuring (call 4 of 6)")
    choice.run(plan, run)
    assert choice.progress(plan) == "measuring ~4096 tokens: call 5 of 6, split (timed 1 of 2)"
    assert "split 8.000 ms (1 of 2 timed)" in choice.table()
    choice.run(plan, run)
    assert choice.progress(plan) is None  # decided
    assert choice.table() == "~4096 tokens: plain 10.000 ms, split 8.000 ms -> split"


def test_inside_the_call_the_progress_describes_that_call():
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0})
    choice = OnlineChoice((PLAIN, SPLIT), trials=1, clock=run.clock)
    plan = _plan(4096)
    seen = []

    def call(schedule: ExpertSchedule) -> str:
        seen.append(choice.progress(plan))
        return run(schedule)

    _drive(choice, call, plan, choice.calls_to_decide + 1)
    assert seen == [f"measuring ~4096 tokens: call {i + 1} of 4, {c} ({k})" for i, (c, k) in
                    enumerate([("plain", "warm-up"), ("plain", "timed 1 of 1"),
                               ("split", "warm-up"), ("split", "timed 1 of 1")])] + [None]


def test_a_decision_is_one_warning_line_and_a_recheck_that_keeps_it_is_quiet(caplog):
    run = FakeRun({PLAIN: 10.0, SPLIT: 8.0})
    choice = OnlineChoice((PLAIN, SPLIT), trials=1, recheck_calls=2, clock=run.clock)
    plan = _plan(4096)
    with caplog.at_level(logging.INFO, logger="dbo.split.online"):
        _drive(choice, run, plan, choice.calls_to_decide)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.name for r in warnings] == ["dbo.split.online"]
        assert warnings[0].getMessage() == "dbo chose ~4096 tokens: plain 10.000 ms, split 8.000 ms -> split"
        caplog.clear()
        _drive(choice, run, plan, 2 + choice.calls_to_decide)  # on its choice, then a recheck
        assert choice.buckets[size_bucket(plan)].decisions == 2
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        caplog.clear()
        run.costs_ms[SPLIT] = 15.0  # the choice changes: said aloud again
        _drive(choice, run, plan, 2 + choice.calls_to_decide)
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert caplog.records[0].getMessage().endswith("-> plain")
