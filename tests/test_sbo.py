"""The ``sbo`` expert schedule (single-batch overlap): the batch unsplit, the shared experts
beside the dispatch, and on a backend that combines per expert group (DeepEP low-latency, here
its fake on 2 gloo ranks) one combine per group of local experts. Every result is compared with
the plain sequential forward."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, note
from hypothesis import strategies as st

from dbo import DBOWrapper, SplitConfig, UBatchError, run_ubatches
from dbo.autotune import NEVER_SPLIT, AutotuneRow, pick_schedule
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.expert_schedule import ExpertSchedule, use_expert_schedule
from dbo.experts import SwiGLUExperts
from dbo.experts.reference import make_expert_weights, relative_error
from dbo.moe import ActivationFormat, MoEKernel, PrepareAndFinalize, topk_route
from dbo.moe.errors import MoEProtocolError
from dbo.moe.kernel import expert_groups
from dbo.split import SplitReason, UBatchPlan, no_split_plan, plan_ubatches
from dbo.testing.conformance import check_backend, default_cases, with_options
from dbo.testing.fake_deep_ep import fake_deepep_backend, fake_deepep_case_backend
from dbo.testing.moe_cases import check_case, standard_cases


def test_expert_groups_cover_the_experts_in_order():
    assert expert_groups(8, 2) == [(0, 4), (4, 8)]
    assert expert_groups(5, 2) == [(0, 2), (2, 5)]
    assert expert_groups(3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert expert_groups(1, 2) == [(0, 1)]
    for n in range(1, 20):
        for g in range(1, 6):
            groups = expert_groups(n, g)
            assert groups[0][0] == 0 and groups[-1][1] == n
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:], strict=False))
    with pytest.raises(ValueError, match="groups"):
        expert_groups(4, 0)


def test_sbo_plans_never_split():
    cfg = SplitConfig(expert_schedule="sbo", decode_token_threshold=1, prefill_token_threshold=1)
    assert cfg.never_splits
    plan = plan_ubatches(64, cfg)
    assert not plan.split and plan.expert_schedule is ExpertSchedule.SBO
    off = plan_ubatches(64, dataclasses.replace(cfg, enabled=False))
    assert off.expert_schedule is ExpertSchedule.PLAIN
    assert no_split_plan(8, expert_schedule="sbo").expert_schedule is ExpertSchedule.SBO
    with pytest.raises(ValueError, match="unsplit plan"):
        no_split_plan(8, expert_schedule="merged")
    with pytest.raises(ValueError, match="split plan"):
        UBatchPlan(8, ((0, 4), (4, 8)), 4, SplitReason.SPLIT, expert_schedule="sbo")
    assert not ExpertSchedule.SBO.splits and ExpertSchedule.MERGED.splits


class _Recorder(PrepareAndFinalize):
    """A one-rank async STANDARD backend that records the order of its launches and receives."""

    def __init__(self, log: list[str]):
        self.log = log

    @property
    def activation_format(self):
        from dbo.moe import ActivationFormat
        return ActivationFormat.STANDARD

    def num_dispatchers(self):
        return 1

    def output_is_reduced(self):
        return True

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config=None):
        from dbo.moe.base import PrepareResult
        self.log.append("dispatch")

        def receiver():
            self.log.append("dispatch_recv")
            return PrepareResult(a1, None, None, None, None)
        return receiver

    def finalize_async(self, output, fused, topk_weights, topk_ids, router_on_input, weight_and_reduce):
        self.log.append("combine")

        def receiver():
            self.log.append("combine_recv")
            weight_and_reduce.apply(output, fused, topk_weights, topk_ids, router_on_input)
        return receiver


def _one_rank_inputs(m=12, hidden=32, inter=16, experts=4, topk=2):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, hidden, generator=g)
    weights, ids = topk_route(torch.randn(m, experts, generator=g), topk, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(experts, hidden, inter, dtype=torch.float32, seed=1)
    return x, weights, ids, w1, w2


def _recording_kernel(log: list[str]) -> MoEKernel:
    """A kernel on the recording backend whose shared experts note when they run."""
    shared_w = torch.randn(32, 32) / 32 ** 0.5

    def shared(h):
        log.append("shared")
        return h @ shared_w

    return MoEKernel(_Recorder(log), SwiGLUExperts(), shared_experts=shared)


@pytest.mark.parametrize("schedule", ["plain", "sbo"])
def test_shared_experts_run_beside_the_dispatch_under_sbo(schedule):
    log: list[str] = []
    kernel = _recording_kernel(log)
    x, weights, ids, w1, w2 = _one_rank_inputs()
    plain = kernel(x, w1, w2, weights, ids, global_num_experts=4)
    log.clear()
    with use_expert_schedule(schedule):
        out = kernel(x, w1, w2, weights, ids, global_num_experts=4)
    assert relative_error(out, plain) < 1e-6
    if schedule == "sbo":
        assert log == ["dispatch", "shared", "dispatch_recv", "combine", "combine_recv"]
    else:
        assert log == ["dispatch", "dispatch_recv", "combine", "shared", "combine_recv"]


def test_sbo_dbo_runs_each_ubatchs_shared_experts_beside_its_dispatch():
    log: list[str] = []
    kernel = _recording_kernel(log)
    x, weights, ids, w1, w2 = _one_rank_inputs(m=16)
    plain = kernel(x, w1, w2, weights, ids, global_num_experts=4)

    def body(rows):
        return lambda: kernel(x[rows], w1, w2, weights[rows], ids[rows], global_num_experts=4)

    for schedule in ("split", "sbo+dbo"):
        log.clear()
        with use_expert_schedule(schedule):
            out = torch.cat(run_ubatches([body(slice(0, 10)), body(slice(10, 16))], token_offsets=[0, 10]))
        assert relative_error(out, plain) < 1e-6
        # each ubatch's shared experts: after its combine's launch (split), right after its
        # dispatch's launch (sbo+dbo)
        after = "combine" if schedule == "split" else "dispatch"
        assert [log[i - 1] for i, e in enumerate(log) if e == "shared"] == [after, after], log
    # outside a run sbo+dbo is the plain layer, as split is
    log.clear()
    with use_expert_schedule("sbo+dbo"):
        assert relative_error(kernel(x, w1, w2, weights, ids, global_num_experts=4), plain) < 1e-6
    assert log == ["dispatch", "dispatch_recv", "combine", "shared", "combine_recv"]


class _CountingLocal(LocalPrepareAndFinalize):
    """The one-process BATCHED_EXPERTS backend, counting its per-group combines."""

    def __init__(self, max_num_tokens: int):
        super().__init__(ActivationFormat.BATCHED_EXPERTS, max_num_tokens=max_num_tokens)
        self.group_combines = 0

    def finalize_group_async(self, *args, **kwargs):
        self.group_combines += 1
        return super().finalize_group_async(*args, **kwargs)


@given(m=st.integers(0, 20), n_experts=st.integers(1, 6), topk=st.integers(1, 3), groups=st.integers(1, 5),
       cut=st.floats(0, 1), empty=st.lists(st.booleans(), min_size=6, max_size=6), seed=st.integers(0, 99))
def test_grouped_schedules_equal_the_plain_layer(m, n_experts, topk, groups, cut, empty, seed):
    # sbo (the batch whole) and sbo+dbo (two ubatches), any number of expert groups, experts that
    # get no row: the same output as the plain layer, one combine per group on a backend that
    # combines per group
    topk = min(topk, n_experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 16, generator=g)
    logits = torch.randn(m, n_experts, generator=g)
    dead = [e for e in range(n_experts) if empty[e]][: n_experts - topk]  # some experts get no row
    logits[:, dead] = float("-inf")
    weights, ids = topk_route(logits, topk, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(n_experts, 16, 8, dtype=torch.float32, seed=seed)
    backend = _CountingLocal(max(m, 1))
    kernel = MoEKernel(backend, SwiGLUExperts(use_triton=False))
    kernel.sbo_groups = groups
    n_groups = len(expert_groups(n_experts, groups))
    note(f"m={m} experts={n_experts} top-{topk} groups={n_groups} no rows for {dead}")

    def layer(rows: slice) -> torch.Tensor:
        return kernel(x[rows], w1, w2, weights[rows], ids[rows], global_num_experts=n_experts)

    plain = layer(slice(None))
    with use_expert_schedule("sbo"):
        sbo = layer(slice(None))
    assert relative_error(sbo, plain) < 1e-5
    assert backend.group_combines == (n_groups if n_groups > 1 else 0)
    k = round(cut * m)
    with use_expert_schedule("sbo+dbo"):
        both = torch.cat(run_ubatches([lambda: layer(slice(0, k)), lambda: layer(slice(k, m))],
                                      token_offsets=[0, k], device="cpu"))
    assert relative_error(both, plain) < 1e-5
    assert backend.group_combines == (3 * n_groups if n_groups > 1 else 0)


def test_sbo_inside_a_run_is_refused():
    kernel = MoEKernel(_Recorder([]), SwiGLUExperts())
    x, weights, ids, w1, w2 = _one_rank_inputs()

    def body():
        return kernel(x, w1, w2, weights, ids, global_num_experts=4)

    with use_expert_schedule("sbo"), pytest.raises(UBatchError) as info:
        run_ubatches([body, body])
    assert isinstance(info.value.__cause__, MoEProtocolError)
    assert "unsplit" in str(info.value.__cause__)


def test_wrapper_runs_sbo_unsplit_and_matches_plain():
    kernel = MoEKernel(_Recorder([]), SwiGLUExperts())
    x, weights, ids, w1, w2 = _one_rank_inputs(m=64)

    def model(h, w, i):
        return kernel(h, w1, w2, w, i, global_num_experts=4)

    plain = model(x, weights, ids)
    wrapped = DBOWrapper(model, SplitConfig(expert_schedule="sbo", decode_token_threshold=1,
                                            prefill_token_threshold=1), agree=False)
    out = wrapped(x, weights, ids)
    assert relative_error(out, plain) < 1e-6
    assert wrapped.last_plan.expert_schedule is ExpertSchedule.SBO and not wrapped.last_plan.split


# ---- multi-rank: the fake DeepEP low-latency backend (per-group combines) and gloo -------------


def _make_ll(case):
    return fake_deepep_case_backend(case, "ll")


def _make_ll_fresh(case):
    # each case its own buffer: the cases differ in experts and dispatch precision
    from dbo.backends.deepep.buffer import BUFFER_CACHE
    BUFFER_CACHE.reset()
    return _make_ll(case)


def _grouped_cases(schedule: str) -> list:
    """The fake DeepEP low-latency cases of a grouped schedule: the default cases (two ubatches
    for sbo+dbo, which deepep_ll allows), 16 experts in 2 and 4 groups, and fp8 dispatch with the
    scales handed to the experts (each group takes its slabs' scales)."""
    base = [c for c in default_cases(2) if c.reduce_in_experts and (schedule == "sbo" or c.num_ubatches == 2)]
    cases = [dataclasses.replace(c, name=f"{c.name} {schedule}", expert_schedule=schedule) for c in base]
    cases += [dataclasses.replace(cases[1], name=f"{schedule} 16 experts G={g}", num_experts=16, topk=4,
                                  sbo_groups=g) for g in (2, 4)]
    cases += [with_options(dataclasses.replace(default_cases(2)[1], name=f"{schedule} fp8 kept", hidden=2048,
                                               tol_ref=6e-2, expert_schedule=schedule),
                           use_fp8_dispatch=True, dequantize_received=False)]
    return cases


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["sbo", "sbo+dbo"])
def test_grouped_schedules_on_fake_deepep_ll_match_plain(world2, schedule):
    # sbo+dbo: two ubatches, each with its groups' combines; each dispatch result is copied out
    # on receive, so no more than two low-latency results are ever alive
    results = check_backend(world2, _make_ll_fresh, _grouped_cases(schedule))
    assert results and all(r.ok for r in results), [r.problems for r in results if not r.ok]


def _group_misuse() -> str:
    from dbo.backends.deepep.buffer import BUFFER_CACHE
    from dbo.moe.weight_and_reduce import TopKWeightAndReduceDelegate
    BUFFER_CACHE.reset()  # the worker's earlier cases sized the shared buffer otherwise
    pf = fake_deepep_backend("ll", hidden=128, max_tokens_per_rank=4, num_experts=8, topk=2,
                             dtype=torch.bfloat16, device="cpu")
    x = torch.randn(4, 128).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(4, 8), 2, ids_dtype=torch.int64)
    prep = pf.prepare(x, weights, ids, 8, None, False)
    out = torch.empty_like(x)
    try:
        pf.finalize_group_async(out, torch.zeros_like(prep.a1q), weights, ids, False,
                                TopKWeightAndReduceDelegate(), experts=(2, 4), last=False)
    except MoEProtocolError as exc:
        return str(exc)
    finally:
        pf.reset()
    return "no error"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_group_combines_must_start_at_expert_zero(world2):
    out = world2.run(_group_misuse, timeout_s=60)
    assert all("expert 0" in o for o in out), out


def _check_gloo(backend: str, schedule: str) -> list[tuple]:
    from dbo.backends.all2all import AllToAllPrepareAndFinalize
    from dbo.backends.naive import NaivePrepareAndFinalize
    make = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}[backend]
    rows = []
    for case in standard_cases(2):
        rep = check_case(case, dist.get_rank(), lambda: make(timeout_s=20.0),
                         expert_schedule=schedule)
        rows.append((rep.err_seq, rep.err_dbo, rep.err_dbo_vs_seq, rep.tol))
    return rows


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["sbo", "sbo+dbo"])
@pytest.mark.parametrize("backend", ["naive", "all2all"])
def test_sbo_on_gloo_matches_plain(world2, backend, schedule):
    per_rank = world2.run(_check_gloo, backend, schedule, timeout_s=120)
    for rows in per_rank:
        for e_seq, e_dbo, e_vs, tol in rows:
            assert max(e_seq, e_dbo, e_vs) <= tol and not math.isnan(e_vs)


def _carveouts_seen() -> list:
    from dbo.backends.deepep.buffer import BUFFER_CACHE
    BUFFER_CACHE.reset()
    seen = []

    class Recording(SwiGLUExperts):
        def apply(self, *args, **kwargs):
            seen.append(self.carveout_in_force())  # the run's value, else the attribute
            return super().apply(*args, **kwargs)

    pf = fake_deepep_backend("ll", hidden=128, max_tokens_per_rank=8, num_experts=8, topk=2,
                             dtype=torch.bfloat16, device="cpu")
    kernel = MoEKernel(pf, Recording(sm_carveout=3))
    kernel.sbo_sm_carveout = 7
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, 128, generator=g).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(8, 8, generator=g), 2, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(8, 128, 32, dtype=torch.bfloat16, seed=0)
    local = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    try:
        with use_expert_schedule("sbo"):
            kernel(x, w1[local], w2[local], weights, ids, global_num_experts=8)
        return [*seen, kernel.experts.sm_carveout]  # the attribute itself is never written
    finally:
        pf.reset()
        BUFFER_CACHE.reset()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_experts_beside_a_combine_leave_the_sbo_carveout(world2):
    # group 0 runs before any combine (its own carve-out); group 1 beside group 0's combine
    assert world2.run(_carveouts_seen, timeout_s=60) == [[3, 7, 3]] * 2


def _make_ll_on_a_link(case):
    from dbo.backends.simulated_link import SimulatedLink, SimulatedLinkPrepareAndFinalize
    return SimulatedLinkPrepareAndFinalize(_make_ll(case), SimulatedLink(50.0, 5.0), "deepep_ll")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_sbo_through_the_simulated_link_matches_plain_and_holds_each_group(world2):
    # the link model passes the group combines through, each held for its group's bytes
    cases = [dataclasses.replace(c, name=f"{c.name} sbo link", expert_schedule="sbo")
             for c in default_cases(2)[:3] if c.reduce_in_experts]
    results = check_backend(world2, _make_ll_on_a_link, cases)
    assert results and all(r.ok for r in results)


def test_sbo_is_chosen_only_where_it_wins_at_every_size():
    def row(t, ser, split, merged, sbo):
        return AutotuneRow(t, ser, split, merged, sbo)

    # sbo beats plain everywhere and nothing splits better: sbo, never split
    rows = [row(32, 1.0, 1.5, 1.1, 0.95), row(64, 1.0, 1.3, 1.05, 0.96)]
    assert pick_schedule(rows) == (ExpertSchedule.SBO, NEVER_SPLIT)
    assert rows[0].best is ExpertSchedule.SBO
    # within the margin at one size: plain (a tie is noise)
    rows = [row(32, 1.0, 1.5, 1.1, 0.99), row(64, 1.0, 1.3, 1.05, 0.9)]
    assert pick_schedule(rows) == (ExpertSchedule.PLAIN, NEVER_SPLIT)
    # split wins more from its threshold on than sbo does everywhere: split
    rows = [row(32, 1.0, 1.2, 1.1, 0.95), row(64, 1.0, 0.6, 0.9, 0.95), row(128, 1.0, 0.5, 0.9, 0.95)]
    assert pick_schedule(rows) == (ExpertSchedule.SPLIT, 64)
    # not measured: never chosen
    rows = [row(32, 1.0, 1.2, 1.1, None)]
    assert pick_schedule(rows) == (ExpertSchedule.PLAIN, NEVER_SPLIT)
