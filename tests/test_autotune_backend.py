"""The autotune over backends (``dbo.autotune.backend``): the pure choice, and a run over three
CPU backends on 2 gloo ranks that leaves the model on the backend every rank chose, whose tuned
wrapper gives the plain forward's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo import SplitConfig, overlapped_forward
from dbo.autotune import NEVER_SPLIT, AutotuneResult, AutotuneRow
from dbo.autotune.backend import BackendChoice, autotune_backend, pick_backend, wrapper_ms
from dbo.expert_schedule import ExpertSchedule
from dbo.testing.dist import DistWorld


def _result(rows: list[tuple[int, float, float | None]], threshold: int,
            schedule: ExpertSchedule = ExpertSchedule.SPLIT) -> AutotuneResult:
    return AutotuneResult(SplitConfig(), True, threshold,
                          tuple(AutotuneRow(t, s, d, None) for t, s, d in rows), 0.02, schedule)


def test_wrapper_time_follows_threshold_and_schedule():
    res = _result([(32, 10.0, 12.0), (64, 20.0, 15.0), (128, 40.0, 25.0)], threshold=64)
    assert wrapper_ms(res) == [10.0, 15.0, 25.0]
    plain = _result([(32, 10.0, 12.0), (64, 20.0, 25.0)], NEVER_SPLIT, ExpertSchedule.PLAIN)
    assert wrapper_ms(plain) == [10.0, 20.0]


def test_pick_backend_costs_each_size_alike_and_keeps_the_default_within_margin():
    a = _result([(32, 10.0, None), (64, 20.0, None)], NEVER_SPLIT, ExpertSchedule.PLAIN)
    b = _result([(32, 5.0, None), (64, 30.0, 15.0)], threshold=64)    # faster at both sizes
    best, costs = pick_backend({"a": a, "b": b})
    assert best == "b"
    assert costs["b"] == pytest.approx(2.0) and costs["a"] == pytest.approx(10 / 5 + 20 / 15)
    near = _result([(32, 9.9, None), (64, 19.9, None)], NEVER_SPLIT, ExpertSchedule.PLAIN)
    assert pick_backend({"a": a, "near": near})[0] == "a"  # 0.5% is within the 2% margin
    assert pick_backend({"near": near, "a": a})[0] == "near"
    with pytest.raises(ValueError, match="different sizes"):
        pick_backend({"a": a, "c": _result([(32, 1.0, None)], NEVER_SPLIT, ExpertSchedule.PLAIN)})
    with pytest.raises(ValueError, match="at least one"):
        pick_backend({})


def _job() -> tuple[str, dict[str, float], str, float]:
    from dbo.backends import make_backend
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
    from dbo.moe import MoEKernel, topk_route
    from dbo.overlap import mask_current_padding

    rank, world = dist.get_rank(), dist.get_world_size()
    w1, w2 = make_expert_weights(4 * world, 64, 32, seed=9)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    router = torch.randn(64, 4 * world, generator=torch.Generator().manual_seed(10))
    built = {name: make_backend(name, None, hidden=64, num_experts=4 * world, topk=2, dtype=torch.float32,
                                device="cpu", max_tokens_per_rank=256)
             for name in ("naive", "all2all", "copy_engine")}
    kernel = MoEKernel(built["naive"], SwiGLUExperts())

    def use(name: str) -> None:
        kernel.prepare_finalize = built[name]

    def layer(h: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_route(h @ router, 2)
        ids, weights = mask_current_padding(ids, weights)
        return kernel(h, w1, w2, weights, ids, global_num_experts=4 * world)

    def make(t: int) -> list[torch.Tensor]:
        return [torch.randn(t, 64, generator=torch.Generator().manual_seed(rank * 1000 + t))]

    choice = autotune_backend(layer, make, [32, 96], backends=["naive", "all2all", "copy_engine"],
                              use_backend=use, decode_only=False, warmup=1, steps=2, rounds=1)
    assert isinstance(choice, BackendChoice) and set(choice.per_backend) == set(built)
    assert pick_backend(choice.per_backend)[0] == choice.backend
    assert kernel.prepare_finalize is built[choice.backend]
    assert choice.backend in choice.table()
    x = make(96)[0]
    out = overlapped_forward(layer, x, config=SplitConfig(prefill_token_threshold=2))
    err = float((out - layer(x)).abs().max())
    return choice.backend, dict(choice.costs), str(choice.result.schedule), err


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_autotune_over_backends_on_two_ranks():
    with DistWorld(2) as world:
        results = world.run(_job)
    assert results[0][:3] == results[1][:3]  # the same backend, costs and schedule on every rank
    assert all(err < 1e-4 for *_, err in results)


def test_bad_backend_lists():
    with pytest.raises(ValueError, match="distinct"):
        autotune_backend(lambda x: x, lambda t: [torch.zeros(t, 1)], [4], backends=[], use_backend=print,
                         decode_only=True)
    with pytest.raises(ValueError, match="distinct"):
        autotune_backend(lambda x: x, lambda t: [torch.zeros(t, 1)], [4], backends=["a", "a"],
                         use_backend=print, decode_only=True)
    with pytest.raises(TypeError, match="callable"):
        autotune_backend(lambda x: x, lambda t: [torch.zeros(t, 1)], [4], backends=["a"], use_backend=None,
                         decode_only=True)
