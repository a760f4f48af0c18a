"""dbo.autotune: the threshold rule (pure, property-tested) and measurements of forwards whose
costs are known.

The measured forward is built so that the answer is known: a fixed per-call cost (a stand-in
for kernel launches and weight reads, paid once per ubatch), then a "communication" that runs
on the link while the ubatch yields, then "compute". Small batches lose under DBO (the fixed
cost is paid twice), large ones win (one ubatch's communication runs during the other's
compute). The costs are spent on a :class:`~dbo.testing.clock.VirtualClock` given to the
autotune, not slept: every timing is exact and the same on any machine, however loaded.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import dbo
from dbo import SplitConfig, dbo_yield, overlapped_forward
from dbo.autotune import (
    NEVER_SPLIT,
    AutotuneRow,
    autotune_split_config,
    pick_schedule,
    pick_threshold,
)
from dbo.expert_schedule import ExpertSchedule, current_expert_schedule
from dbo.split import plan_ubatches
from dbo.testing.clock import VirtualClock
from dbo.testing.dist import DistJobError

FIXED_S = 0.002
PER_TOKEN_S = 1e-5  # communication and compute each


def costed_forward(clock: VirtualClock):
    """``x * 2`` that costs FIXED_S, then sends PER_TOKEN_S a token while it yields, then
    computes PER_TOKEN_S a token, on ``clock``."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        clock.spend(FIXED_S)
        comm = clock.send(PER_TOKEN_S * t)
        dbo_yield()
        clock.wait(comm)
        clock.spend(PER_TOKEN_S * t)
        return x * 2

    return fn


def test_virtual_clock_queues_transfers_and_overlaps_them_with_work():
    clock = VirtualClock()
    a = clock.send(2.0)           # the link: 0 -> 2
    b = clock.send(1.0)           # queued behind it: 2 -> 3
    clock.spend(2.5)              # work meanwhile: 0 -> 2.5
    clock.wait(a)                 # ended already
    assert clock() == 2.5
    clock.wait(b)
    assert clock() == 3.0 and clock.send(0.5) == 3.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds"):
            clock.spend(bad)
        with pytest.raises(ValueError, match="seconds"):
            clock.send(bad)


rows_strategy = st.lists(
    st.tuples(st.integers(1, 10_000), st.floats(0.01, 100), st.one_of(st.none(), st.floats(0.01, 100))),
    max_size=8, unique_by=lambda r: r[0],
).map(lambda rs: [AutotuneRow(t, s, d) for t, s, d in rs])


@given(rows_strategy, st.floats(0, 0.5))
def test_threshold_is_where_dbo_wins_from_there_on(rows, margin):
    thr = pick_threshold(rows, margin)
    note(f"threshold {thr}")

    def wins(r: AutotuneRow) -> bool:
        return r.dbo_ms is not None and r.dbo_ms <= r.serial_ms * (1 - margin)

    above = [r for r in rows if r.tokens >= thr]
    assert all(wins(r) for r in above)
    below = sorted((r for r in rows if r.tokens < thr), key=lambda r: r.tokens)
    if below:  # the largest size below the threshold lost: the threshold is the smallest possible
        assert not wins(below[-1])
    if thr != NEVER_SPLIT:
        assert thr in {r.tokens for r in rows}
    # a stricter margin never splits more
    assert pick_threshold(rows, min(0.99, margin + 0.1)) >= thr


def test_threshold_examples_and_errors():
    r = [AutotuneRow(32, 1.0, 1.5), AutotuneRow(64, 1.0, 0.9), AutotuneRow(128, 1.0, 0.8)]
    assert pick_threshold(r) == 64
    assert pick_threshold(r, margin=0.15) == 128
    assert pick_threshold([AutotuneRow(32, 1.0, 0.5), AutotuneRow(64, 1.0, 1.2)]) == NEVER_SPLIT
    assert pick_threshold([]) == NEVER_SPLIT
    with pytest.raises(ValueError, match="distinct"):
        pick_threshold([AutotuneRow(32, 1.0, 0.5), AutotuneRow(32, 1.0, 0.5)])
    with pytest.raises(ValueError, match="margin"):
        pick_threshold(r, margin=1.0)


def test_autotune_finds_the_crossover_and_the_wrapper_follows_it():
    clock = VirtualClock()
    fn = costed_forward(clock)
    res = autotune_split_config(fn, lambda t: [torch.ones(t, 4)], [2000, 25, 50, 4000],
                                decode_only=True, warmup=1, steps=3, rounds=3, clock=clock)
    assert [r.tokens for r in res.rows] == [25, 50, 2000, 4000]
    # expected ratios: about 1.7 at 25-50 tokens (the fixed cost twice), 0.76 at 2000 and 4000
    assert res.rows[0].ratio > 1.1 and res.rows[1].ratio > 1.1, res.table()
    assert res.rows[3].ratio < 0.9, res.table()
    # plain 2 + 0.02 t ms; overlapped: the second ubatch's fixed cost, both transfers back to
    # back, the last ubatch's compute: 2 + 2 + 0.01 t + 0.005 t ms (from 2000 tokens on)
    assert res.rows[2].serial_ms == pytest.approx(42.0) and res.rows[2].dbo_ms == pytest.approx(32.0)
    assert res.threshold == 2000, res.table()
    assert res.config.decode_token_threshold == res.threshold
    assert res.config.prefill_token_threshold == SplitConfig().prefill_token_threshold
    # the wrapper with the tuned config splits where DBO won, and gives the plain numbers
    assert not plan_ubatches(50, res.config, decode_only=True).split
    assert plan_ubatches(4000, res.config, decode_only=True).split
    x = torch.randn(4000, 4)
    torch.testing.assert_close(overlapped_forward(fn, x, config=res.config, decode_only=True), x * 2,
                               rtol=0, atol=0)
    assert f"threshold: split >= {res.threshold} tokens" in res.table()


def test_autotune_never_splits_when_dbo_never_wins():
    clock = VirtualClock()

    def fn(x: torch.Tensor) -> torch.Tensor:  # no communication to hide: DBO only adds cost
        clock.spend(FIXED_S)
        dbo_yield()
        return x + 1

    res = autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [64, 512], decode_only=False,
                                warmup=0, steps=2, rounds=1, clock=clock)
    assert [r.ratio for r in res.rows] == pytest.approx([2.0, 2.0]), res.table()
    assert res.threshold == NEVER_SPLIT and res.schedule is ExpertSchedule.PLAIN
    assert res.config.prefill_token_threshold == NEVER_SPLIT
    assert res.config.expert_schedule is SplitConfig().expert_schedule  # the input's
    assert not plan_ubatches(10**9, res.config, decode_only=False).split
    assert "split never" in res.table()


# ---- three schedules ------------------------------------------------------------------------

rows3_strategy = st.lists(
    st.tuples(st.integers(1, 10_000), st.floats(0.01, 100), st.one_of(st.none(), st.floats(0.01, 100)),
              st.one_of(st.none(), st.floats(0.01, 100))),
    max_size=8, unique_by=lambda r: r[0],
).map(lambda rs: [AutotuneRow(*r) for r in rs])


@given(rows3_strategy, st.floats(0, 0.5))
def test_schedule_choice_is_a_threshold_that_wins_from_there_on(rows, margin):
    schedule, thr = pick_schedule(rows, margin)
    note(f"{schedule} from {thr}")
    if schedule is ExpertSchedule.PLAIN:
        assert thr == NEVER_SPLIT
        for s in (ExpertSchedule.SPLIT, ExpertSchedule.MERGED):  # neither won at the largest size
            assert pick_threshold([AutotuneRow(r.tokens, r.serial_ms, r.ms(s)) for r in rows],
                                  margin) == NEVER_SPLIT
        return
    timed = [AutotuneRow(r.tokens, r.serial_ms, r.ms(schedule)) for r in rows]
    assert thr == pick_threshold(timed, margin)
    assert all(r.dbo_ms is not None and r.dbo_ms <= r.serial_ms * (1 - margin)
               for r in timed if r.tokens >= thr)
    # the split schedule's own measurements alone give the old answer when merged is absent
    only_split = [AutotuneRow(r.tokens, r.serial_ms, r.dbo_ms) for r in rows]
    s2, t2 = pick_schedule(only_split, margin)
    assert t2 == pick_threshold(only_split, margin)
    assert s2 is (ExpertSchedule.PLAIN if t2 == NEVER_SPLIT else ExpertSchedule.SPLIT)


def test_schedule_choice_examples():
    def row(t, ser, split, merged):
        return AutotuneRow(t, ser, split, merged)

    # merged wins at small sizes and nearly ties at large ones: merged everywhere
    rows = [row(32, 1.0, 1.3, 0.8), row(64, 1.0, 1.1, 0.8), row(512, 1.0, 0.7, 0.71)]
    assert pick_schedule(rows) == (ExpertSchedule.MERGED, 32)
    # merged only matches split: split is kept (merged must win by the margin)
    rows = [row(32, 1.0, 0.9, 0.89), row(64, 1.0, 0.8, 0.8)]
    assert pick_schedule(rows) == (ExpertSchedule.SPLIT, 32)
    # no DBO schedule wins at the largest size: plain
    rows = [row(32, 1.0, 0.5, 0.5), row(64, 1.0, 1.2, 1.1)]
    assert pick_schedule(rows) == (ExpertSchedule.PLAIN, NEVER_SPLIT)
    assert rows[0].best is ExpertSchedule.SPLIT and rows[1].best is ExpertSchedule.PLAIN
    assert row(8, 1.0, None, 0.5).best is ExpertSchedule.MERGED


FIXED_EXPERTS_S = 0.010


def weights_bound_forward(clock: VirtualClock):
    """An MoE-like forward whose "experts" pay a fixed weight read after the dispatch: once per
    ubatch with the split schedule, once per step with the merged one (ubatch 0 pays it)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        comm = clock.send(PER_TOKEN_S * t)
        dbo_yield()
        clock.wait(comm)
        merged = dbo.dbo_enabled() and current_expert_schedule() is ExpertSchedule.MERGED
        if not merged or dbo.dbo_current_ubatch_id() == 0:
            clock.spend(FIXED_EXPERTS_S)
        clock.spend(PER_TOKEN_S * t)
        return x * 2

    return fn


def test_autotune_measures_three_schedules_and_picks_merged_where_weights_dominate():
    # expected per call (ms): 1000 tokens: serial 30, split 35, merged 25; 6000 tokens: serial
    # 130, split 110, merged 100. Merged wins at both sizes, split only at the larger one.
    clock = VirtualClock()
    res = autotune_split_config(weights_bound_forward(clock), lambda t: [torch.ones(t, 4)],
                                [1000, 6000], decode_only=False, warmup=1, steps=3, rounds=2,
                                clock=clock)
    table = res.table()
    small, large = res.rows
    assert small.ratio > 1.05 and small.merged_ratio < 0.93, table
    assert large.ratio < 0.9 and large.merged_ms < large.dbo_ms, table
    assert [(r.serial_ms, r.dbo_ms, r.merged_ms) for r in res.rows] == [
        pytest.approx((30.0, 35.0, 25.0)), pytest.approx((130.0, 110.0, 100.0))], table
    assert small.best is ExpertSchedule.MERGED, table
    assert res.schedule is ExpertSchedule.MERGED and res.threshold == 1000, table
    assert res.config.expert_schedule is ExpertSchedule.MERGED
    assert res.config.prefill_token_threshold == 1000
    assert "merged experts" in table and "merged ms" in table
    # the wrapper with the tuned config runs the merged schedule, with the plain numbers
    x = torch.randn(2000, 4)
    trace = dbo.Trace()
    out = overlapped_forward(weights_bound_forward(VirtualClock()), x, config=res.config, trace=trace)
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert trace.meta["expert_schedule"] == "merged"
    # measuring the split schedule only gives the old, split-only answer
    clock = VirtualClock()
    only = autotune_split_config(weights_bound_forward(clock), lambda t: [torch.ones(t, 4)],
                                 [1000, 6000], decode_only=False, warmup=1, steps=3, rounds=2,
                                 schedules=["split"], clock=clock)
    assert only.schedule is ExpertSchedule.SPLIT and only.threshold == 6000, only.table()
    assert all(r.merged_ms is None for r in only.rows)
    assert only.config.expert_schedule is ExpertSchedule.SPLIT


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_overlapped_runs_get_the_carveout_and_plain_runs_do_not():
    seen = set()

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.add((dbo.dbo_enabled(), torch._C._get_sm_carveout_experimental()))
        dbo_yield()
        return x + 1

    before = torch._C._get_sm_carveout_experimental()
    autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [8], decode_only=False, warmup=0,
                          steps=1, rounds=1, sm_carveout=6)
    assert seen == {(False, before), (True, 6)}
    assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_autotune_picks_the_carveout_whose_choice_costs_least():
    # DBO wins only when the overlapped runs leave 16 SMs free (a stand-in for DeepEP's kernels
    # that wait for SMs otherwise): 20 ms plain; overlapped 12 ms with 16 free, else 30 ms
    clock = VirtualClock()

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.dbo_enabled():
            free = torch._C._get_sm_carveout_experimental()
            clock.spend(0.006 if free == 16 else 0.015)  # per ubatch
            dbo_yield()
        else:
            clock.spend(0.020)
        return x + 1

    before = torch._C._get_sm_carveout_experimental()
    res = autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [8, 16], decode_only=False,
                                warmup=0, steps=2, rounds=1, schedules=["split"], sm_carveouts=(None, 16),
                                clock=clock)
    assert res.sm_carveout == 16 and res.carveouts_tried == (None, 16), res.table()
    assert res.schedule is ExpertSchedule.SPLIT and res.threshold == 8, res.table()
    assert all(r.ratio < 0.8 for r in res.rows), res.table()  # the rows are the 16's runs
    assert "SM carve-out: 16 (of none, 16" in res.table()
    # where no carve-out makes DBO win, the first is kept and the forward stays plain
    res = autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [8], decode_only=False,
                                warmup=0, steps=1, rounds=1, schedules=["split"], sm_carveouts=(None, 8),
                                clock=clock)
    assert res.sm_carveout is None and res.schedule is ExpertSchedule.PLAIN, res.table()
    assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.parametrize("kwargs, match", [
    (dict(sm_carveouts=[]), "sm_carveouts"),
    (dict(sm_carveouts=[8, 8]), "sm_carveouts"),
    (dict(sm_carveouts=[None, -1]), "sm_carveout"),
    (dict(token_counts=[]), "token_counts"),
    (dict(token_counts=[0, 4]), "token_counts"),
    (dict(token_counts=[4, 4]), "token_counts"),
    (dict(steps=0), "steps"),
    (dict(margin=-0.1), "margin"),
    (dict(sm_carveout=-2), "sm_carveout"),
    (dict(schedules=["plain"]), "schedules"),
    (dict(schedules=[]), "schedules"),
    (dict(schedules=["fused"]), "expert_schedule"),
])
def test_bad_arguments(kwargs, match):
    args = dict(token_counts=[4, 8], steps=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        autotune_split_config(lambda x: x, lambda t: [torch.zeros(t)], decode_only=True, **args)


def test_a_clock_that_is_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="clock must be callable"):
        autotune_split_config(lambda x: x, lambda t: [torch.zeros(t)], [4], decode_only=True,
                              clock=0.0)


# ---- two ranks over gloo: the same answer everywhere, and mismatches fail on every rank -------


def _tune_job(counts_by_rank: list[list[int]]) -> tuple:
    import torch.distributed as dist

    rank = dist.get_rank()
    clock = VirtualClock()

    def fn(x: torch.Tensor) -> torch.Tensor:
        # a collective per call, as an MoE forward has; rank 1 is slower, so it sets the pace
        clock.spend(0.001 * (1 + rank))
        y = x.clone()
        dist.all_reduce(y)
        dbo_yield()
        return y

    res = autotune_split_config(fn, lambda t: [torch.ones(t, 3)], counts_by_rank[rank],
                                decode_only=False, warmup=1, steps=2, rounds=1, clock=clock)
    return res.threshold, res.rows


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_ranks_get_the_same_answer(world2):
    (thr0, rows0), (thr1, rows1) = world2.run(_tune_job, [[8, 64], [8, 64]])
    assert thr0 == thr1 and rows0 == rows1
    # the slowest rank's time: rank 1 spends 2 ms per call (rank 0 1 ms)
    assert all(r.serial_ms == pytest.approx(2.0, abs=1e-5) for r in rows0), rows0


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_different_token_counts_fail_on_every_rank(world2):
    with pytest.raises(DistJobError) as info:
        world2.run(_tune_job, [[8, 64], [8, 128]])
    assert [o.ok for o in info.value.outcomes] == [False, False]
    assert all("different token_counts" in o.error for o in info.value.outcomes)


def _never_job() -> list[float]:
    import torch.distributed as dist

    from dbo.split import NEVER_SPLIT

    # rank 0 plans with a never-split config, rank 1 does not plan at all: no collective may
    # be issued for it, or the all-reduce below would pair with the plan's and fail or hang
    if dist.get_rank() == 0:
        plan = plan_ubatches(10**6, SplitConfig(decode_token_threshold=NEVER_SPLIT,
                                                prefill_token_threshold=NEVER_SPLIT))
        assert not plan.split
    t = torch.tensor([1.0 + dist.get_rank()])
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_never_split_config_issues_no_collective(world2):
    assert world2.run(_never_job, timeout_s=30) == [[3.0], [3.0]]
