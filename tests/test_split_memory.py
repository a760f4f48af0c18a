"""SplitConfig.min_free_bytes: a rank short of device memory votes no, and the whole group runs
the plain forward instead of one rank running out of memory in the overlapped call while its
peers wait for it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo.autotune import autotune_split_config
from dbo.expert_schedule import ExpertSchedule
from dbo.overlap import current_ubatch
from dbo.split import SplitConfig, SplitReason, free_device_bytes, plan_ubatches
from dbo.testing.clock import VirtualClock
from dbo.testing.dist import DistWorld

GIB = 2**30


def _cfg(**kw) -> SplitConfig:
    return SplitConfig(decode_token_threshold=1, prefill_token_threshold=1, **kw)


def test_a_rank_short_of_memory_runs_plainly():
    cfg = _cfg(min_free_bytes=4 * GIB)
    assert plan_ubatches(64, cfg, free_bytes=8 * GIB).split
    plan = plan_ubatches(64, cfg, free_bytes=3 * GIB)
    assert not plan.split and plan.reason is SplitReason.MEMORY
    assert "3.00 GiB free" in plan.detail and "needs 4.00 GiB" in plan.detail
    # no check unless asked for; and where the free memory is not known (the CPU)
    assert plan_ubatches(64, _cfg(), free_bytes=0).split
    assert free_device_bytes("cpu") is None
    assert plan_ubatches(64, cfg, device="cpu").split
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_free_bytes"):
            _cfg(min_free_bytes=bad)


def _plan(free_per_rank: list[int]) -> tuple[bool, str]:
    cfg = _cfg(min_free_bytes=4 * GIB)
    plan = plan_ubatches(64, cfg, free_bytes=free_per_rank[dist.get_rank()])
    return plan.split, plan.reason.value


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_whole_group_falls_back_together():
    with DistWorld(2) as world:
        assert world.run(_plan, [8 * GIB, 2 * GIB], timeout_s=60) == [
            (False, "disagreement"), (False, "memory")]
        assert world.run(_plan, [8 * GIB, 5 * GIB], timeout_s=60) == [(True, "split")] * 2


def test_a_call_that_does_not_fit_even_unsplit_is_refused_before_it_starts():
    from dbo.errors import DeviceMemoryError

    for cfg in (_cfg(), SplitConfig(enabled=False)):  # a config that never splits checks it too
        assert plan_ubatches(64, cfg, free_bytes=3 * GIB, need_bytes=2 * GIB) is not None
        assert plan_ubatches(64, cfg, free_bytes=1 * GIB) is not None  # no need given
        want = r"rank 0 is short .*: 1.00 GiB free, about 2.00 GiB needed"
        with pytest.raises(DeviceMemoryError, match=want) as e:
            plan_ubatches(64, cfg, free_bytes=1 * GIB, need_bytes=2 * GIB)
        assert (e.value.rank, e.value.free_bytes, e.value.need_bytes) == (0, GIB, 2 * GIB)
        assert isinstance(e.value, MemoryError)


def _refused(free_per_rank: list[int], config: SplitConfig) -> object:
    from dbo.errors import DeviceMemoryError

    try:
        return plan_ubatches(64, config, free_bytes=free_per_rank[dist.get_rank()],
                             need_bytes=4 * GIB).split
    except DeviceMemoryError as exc:
        return ("refused", exc.rank, exc.free_bytes // GIB)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_every_rank_refuses_a_call_one_rank_has_no_room_for():
    # the lowest short rank is named, with its free memory, on every rank; a group with room
    # goes on as before, also under a config that never splits (the vote still runs)
    with DistWorld(3) as world:
        assert world.run(_refused, [8 * GIB, 2 * GIB, 3 * GIB], _cfg(), timeout_s=60) == [
            ("refused", 1, 2)] * 3
        assert world.run(_refused, [8 * GIB, 1 * GIB, 5 * GIB], SplitConfig(enabled=False),
                         timeout_s=60) == [("refused", 1, 1)] * 3
        assert world.run(_refused, [8 * GIB, 5 * GIB, 6 * GIB], _cfg(), timeout_s=60) == [True] * 3


def test_autotune_asks_for_the_memory_its_overlapped_calls_took(monkeypatch):
    # on CUDA the autotune reads each overlapped call's transient peak; here a stand-in reports
    # 1000 bytes for split calls: the tuned config then splits only where that (+10%) is free
    import dbo.autotune.split as split_mod

    monkeypatch.setattr(split_mod, "transient_bytes", lambda step, device: 1000)
    clock = VirtualClock()

    def forward(x: torch.Tensor) -> torch.Tensor:  # 10 ms plainly, 3 ms a ubatch: split wins
        clock.spend(0.010 if current_ubatch() is None else 0.003)
        return x * 2

    res = autotune_split_config(forward, lambda t: [torch.ones(t, 4)], [2000, 4000],
                                decode_only=True, warmup=1, steps=2, rounds=1, clock=clock,
                                schedules=("split",))
    assert res.schedule is ExpertSchedule.SPLIT and res.config.min_free_bytes == 1100
    assert plan_ubatches(4000, res.config, decode_only=True, free_bytes=2000).split
    assert not plan_ubatches(4000, res.config, decode_only=True, free_bytes=1000).split
