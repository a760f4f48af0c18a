"""The expert schedules (plain, split, merged) in one process: config and plan, numbers equal to
the plain forward in both activation formats, the trace, and failures in the rendezvous.

Multi-rank backends (gloo, fake DeepEP) are in tests/test_schedules_dist.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import dbo
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.expert_schedule import ExpertSchedule, current_expert_schedule, use_expert_schedule
from dbo.experts import SwiGLUExperts, make_expert_weights, relative_error
from dbo.moe import ActivationFormat, ExpertTokensMetadata, MergedScheduleError, MoEKernel, topk_route
from dbo.moe import merged as merged_mod
from dbo.overlap import mask_current_padding
from dbo.split import SplitConfig, SplitReason, UBatchPlan, Vote, local_vote, plan_ubatches

ALWAYS = dict(decode_token_threshold=1, prefill_token_threshold=1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# ---- config and plan ------------------------------------------------------------------------


def test_config_field_is_validated_and_part_of_the_agreement():
    assert SplitConfig().expert_schedule is ExpertSchedule.SPLIT
    cfg = SplitConfig(expert_schedule="merged")
    assert cfg.expert_schedule is ExpertSchedule.MERGED
    with pytest.raises(ValueError, match="expert_schedule must be one of"):
        SplitConfig(expert_schedule="fused")
    keys = {SplitConfig(expert_schedule=s).agreement_key() for s in ExpertSchedule}
    assert len(keys) == len(ExpertSchedule) == 5


def test_plan_carries_the_schedule():
    plan = plan_ubatches(64, SplitConfig(expert_schedule="merged", **ALWAYS), agree=False)
    assert plan.split and plan.expert_schedule is ExpertSchedule.MERGED
    assert "merged experts" in str(plan)
    assert plan_ubatches(64, SplitConfig(**ALWAYS)).expert_schedule is ExpertSchedule.SPLIT
    # a plan that does not split runs plainly, whatever was asked
    small = plan_ubatches(4, SplitConfig(expert_schedule="merged"))
    assert not small.split and small.expert_schedule is ExpertSchedule.PLAIN
    plain = SplitConfig(expert_schedule="plain", **ALWAYS)
    d = local_vote(64, plain)
    assert d.vote is Vote.NO and d.reason is SplitReason.DISABLED and "plain" in d.detail
    assert plain.never_splits and not SplitConfig().never_splits
    with pytest.raises(ValueError, match="not 'plain'"):
        UBatchPlan(4, ((0, 2), (2, 4)), 2, SplitReason.SPLIT, expert_schedule="plain")


def test_setting_is_scoped():
    assert current_expert_schedule() is ExpertSchedule.SPLIT
    with use_expert_schedule("merged") as s:
        assert s is ExpertSchedule.MERGED and current_expert_schedule() is s
    assert current_expert_schedule() is ExpertSchedule.SPLIT
    with pytest.raises(ValueError), use_expert_schedule("nope"):
        pass


# ---- a small model ----------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    """``layers`` residual layers: a stand-in attention, then a routed MoE (one kernel each)."""

    kernels: list[MoEKernel]
    w1: torch.Tensor
    w2: torch.Tensor
    mix: torch.Tensor
    num_experts: int
    topk: int
    fail_at: tuple[int, int] | None = None  # (ubatch, layer): raise in that attention
    skip_ubatch: int | None = None  # this ubatch returns before the first MoE layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ub = dbo.dbo_current_ubatch_id()
        if dbo.dbo_enabled() and ub == self.skip_ubatch:
            return x
        for layer, k in enumerate(self.kernels):
            with dbo.dbo_region("attention"):
                a = torch.tanh(x @ self.mix)
            if dbo.dbo_enabled() and self.fail_at == (ub, layer):
                raise ValueError(f"boom in ubatch {ub} layer {layer}")
            logits = (a.float() @ self.mix.float())[:, : self.num_experts]
            w, ids = topk_route(logits, self.topk)
            ids, w = mask_current_padding(ids, w)
            x = x + k(a, self.w1, self.w2, w, ids, global_num_experts=self.num_experts)
        return x


def make_model(fmt: ActivationFormat, *, layers: int = 2, experts: int = 6, hidden: int = 16,
               topk: int = 2, dtype: torch.dtype = torch.float32, reduce: bool = True,
               seed: int = 0, shared: bool = False) -> Model:
    w1, w2 = make_expert_weights(experts, hidden, 8, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mix = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(dtype)
    shared_fn = (lambda h: 0.5 * h) if shared else None
    kernels = [MoEKernel(LocalPrepareAndFinalize(fmt), SwiGLUExperts(reduce_in_experts=reduce),
                         shared_experts=shared_fn) for _ in range(layers)]
    return Model(kernels, w1, w2, mix, experts, topk)


def _inputs(tokens: int, hidden: int = 16, dtype: torch.dtype = torch.float32, seed: int = 1):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _regions(trace: dbo.Trace) -> list[str]:
    return [e.detail for e in trace.events if e.kind == "region_begin"]


# ---- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(ActivationFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_schedule_equals_the_plain_forward(fmt, reduce, dtype):
    model = make_model(fmt, reduce=reduce, dtype=dtype, shared=True, layers=3)
    x = _inputs(23, dtype=dtype)
    plain = model(x)
    for schedule in ("plain", "split", "merged"):
        for n in (2, 3):
            cfg = SplitConfig(num_ubatches=n, expert_schedule=schedule, **ALWAYS)
            trace = dbo.Trace()
            out = dbo.overlapped_forward(model, x, config=cfg, trace=trace)
            err = relative_error(out, plain)
            assert err <= TOL[dtype], f"{schedule} n={n}: {err}"
            regions = _regions(trace)
            if schedule == "plain":
                assert not trace.events  # never split
                continue
            assert trace.meta["expert_schedule"] == schedule
            if schedule == "merged":
                # one merged call per layer; the other ubatches wait at it
                assert regions.count("experts_merged") == 3 and "experts" not in regions
                assert regions.count("experts_wait") == 3 * (n - 1)
            else:
                assert regions.count("experts") == 3 * n and "experts_merged" not in regions
            kinds = [e.kind for e in trace.events]
            assert kinds.count("hook_register") == kinds.count("hook_begin")
    assert all(len(k._rendezvous) == 0 for k in model.kernels)


def test_merged_keeps_dispatch_and_combine_per_ubatch_and_reads_the_weights_once():
    """Each ubatch dispatches and combines on its own; the experts run once per layer on
    every ubatch's rows."""
    model = make_model(ActivationFormat.STANDARD, layers=2)
    calls: list[int] = []
    for k in model.kernels:
        inner = k.experts.apply

        def spy(hidden_states, *a, _inner=inner, **kw):
            calls.append(hidden_states.shape[0])
            return _inner(hidden_states, *a, **kw)

        k.experts.apply = spy
    x = _inputs(20)
    trace = dbo.Trace()
    dbo.overlapped_forward(model, x, config=SplitConfig(expert_schedule="merged", **ALWAYS),
                           trace=trace)
    assert calls == [20, 20]  # one call per layer over both ubatches' 10 + 10 rows
    regions = [(e.ubatch, e.detail) for e in trace.events if e.kind == "region_begin"]
    for ub in (0, 1):
        assert [d for u, d in regions if u == ub].count("dispatch") == 2
        assert [d for u, d in regions if u == ub].count("combine") == 2


def test_wrapper_and_a_kernel_called_twice_per_forward():
    model = make_model(ActivationFormat.BATCHED_EXPERTS, layers=1)
    model.kernels = model.kernels * 3  # one layer object used three times
    x = _inputs(17)
    plain = model(x)
    wrapped = dbo.DBOWrapper(model, SplitConfig(expert_schedule="merged", adaptive=False, **ALWAYS),
                             agree=False)
    trace = dbo.Trace()
    out = wrapped(x, trace=trace)
    assert wrapped.last_plan.expert_schedule is ExpertSchedule.MERGED
    assert relative_error(out, plain) <= 1e-5
    assert _regions(trace).count("experts_merged") == 3
    assert trace.to_chrome()["otherData"] == {"expert_schedule": "merged"}


def test_merged_outside_a_run_is_the_plain_call():
    model = make_model(ActivationFormat.STANDARD)
    x = _inputs(9)
    plain = model(x)
    with use_expert_schedule("merged"):
        assert relative_error(model(x), plain) == 0


# ---- failures -----------------------------------------------------------------------------


def _merged_run(model: Model, x: torch.Tensor, n: int = 2) -> torch.Tensor:
    cfg = SplitConfig(num_ubatches=n, expert_schedule="merged", **ALWAYS)
    return dbo.overlapped_forward(model, x, config=cfg)


def _assert_clean_and_reusable(model: Model, x: torch.Tensor) -> None:
    assert all(len(k._rendezvous) == 0 for k in model.kernels)
    model.fail_at = model.skip_ubatch = None
    assert relative_error(_merged_run(model, x), model(x)) <= 1e-5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layer", [0, 1])
def test_a_peer_that_fails_before_the_rendezvous_unwinds_the_waiter(layer):
    model = make_model(ActivationFormat.STANDARD, layers=2)
    model.fail_at = (1, layer)
    x = _inputs(12)
    with pytest.raises(dbo.UBatchError) as info:
        _merged_run(model, x)
    assert info.value.ubatch_id == 1 and isinstance(info.value.__cause__, ValueError)
    _assert_clean_and_reusable(model, x)


@pytest.mark.timeout(30)
def test_merged_experts_that_raise_unwind_the_waiters():
    model = make_model(ActivationFormat.STANDARD, layers=2)
    k = model.kernels[1]
    inner = k.experts.apply

    callers = []

    def broken(*a, **kw):
        callers.append(dbo.dbo_current_ubatch_id())
        raise RuntimeError("experts broke")

    k.experts.apply = broken
    x = _inputs(12)
    with pytest.raises(dbo.UBatchError) as info:
        _merged_run(model, x, n=3)
    # one merged call, by the last ubatch to arrive, whose failure is reported
    assert len(callers) == 1 and info.value.ubatch_id == callers[0]
    assert isinstance(info.value.__cause__, RuntimeError)
    k.experts.apply = inner
    _assert_clean_and_reusable(model, x)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2, 3])
def test_a_peer_that_never_arrives_raises_instead_of_spinning(n):
    model = make_model(ActivationFormat.STANDARD)
    model.skip_ubatch = n - 1
    x = _inputs(12)
    with pytest.raises(dbo.UBatchError) as info:
        _merged_run(model, x, n=n)
    assert isinstance(info.value.__cause__, MergedScheduleError)
    assert f"waits for ubatches [{n - 1}]" in str(info.value.__cause__)
    _assert_clean_and_reusable(model, x)


@pytest.mark.timeout(30)
def test_peers_waiting_at_different_layers_raise_after_the_idle_limit(monkeypatch):
    monkeypatch.setattr(merged_mod, "MAX_IDLE_YIELDS", 50)
    model = make_model(ActivationFormat.STANDARD, layers=2)
    a, b = model.kernels
    w1, w2 = model.w1, model.w2
    x = _inputs(4)
    w, ids = topk_route(torch.randn(4, model.num_experts), 2)

    def body(kernel):
        return lambda: kernel(x, w1, w2, w, ids, global_num_experts=model.num_experts)

    with use_expert_schedule("merged"), pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches([body(a), body(a), body(b)], device="cpu")
    assert isinstance(info.value.__cause__, MergedScheduleError)
    assert "resumed" in str(info.value.__cause__)
    assert len(a._rendezvous) == 0 and len(b._rendezvous) == 0


def test_ubatches_with_different_weights_are_refused():
    model = make_model(ActivationFormat.STANDARD)
    k = model.kernels[0]
    x = _inputs(4)
    w, ids = topk_route(torch.randn(4, model.num_experts), 2)

    def body(w1):
        return lambda: k(x, w1, model.w2, w, ids, global_num_experts=model.num_experts)

    with use_expert_schedule("merged"), pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches([body(model.w1), body(model.w1.clone())], device="cpu")
    assert isinstance(info.value.__cause__, MergedScheduleError)
    assert len(k._rendezvous) == 0


def test_reset_drops_a_rendezvous_in_progress():
    model = make_model(ActivationFormat.STANDARD)
    k = model.kernels[0]
    x = _inputs(4)
    w, ids = topk_route(torch.randn(4, model.num_experts), 2)

    def waits():
        return k(x, model.w1, model.w2, w, ids, global_num_experts=model.num_experts)

    def resets():
        dbo.dbo_yield()  # ubatch 0 is now waiting at the rendezvous
        assert len(k._rendezvous) == 1
        k.reset()
        dbo.dbo_yield()
        return x

    with use_expert_schedule("merged"), pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches([waits, resets], device="cpu")
    assert info.value.ubatch_id == 0 and "dropped" in str(info.value.__cause__)


# ---- property: any split, format and failure ------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_merged_runs_match_split_and_plain(data):
    fmt = data.draw(st.sampled_from(list(ActivationFormat)), label="format")
    n = data.draw(st.integers(2, 4), label="ubatches")
    layers = data.draw(st.integers(1, 3), label="layers")
    sizes = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n), label="rows")
    topk = data.draw(st.integers(1, 4), label="topk")
    reduce = data.draw(st.booleans(), label="reduce_in_experts")
    fail = data.draw(st.none() | st.tuples(st.integers(0, n - 1), st.integers(0, layers - 1)),
                     label="fail_at")
    model = make_model(fmt, layers=layers, topk=topk, reduce=reduce, seed=sum(sizes))
    total = sum(sizes)
    x = _inputs(total, seed=topk)
    plain = model(x)
    cuts = [sum(sizes[:i]) for i in range(n + 1)]
    parts = [x[cuts[i]:cuts[i + 1]] for i in range(n)]
    model.fail_at = fail
    outs = {}
    for schedule in ("split", "merged"):
        trace = dbo.Trace()
        try:
            with use_expert_schedule(schedule):
                got = dbo.run_ubatches([lambda p=p: model(p) for p in parts], device="cpu",
                                       trace=trace)
        except dbo.UBatchError as exc:
            assert fail is not None and exc.ubatch_id == fail[0], exc
            assert all(len(k._rendezvous) == 0 for k in model.kernels)
            continue
        assert fail is None
        outs[schedule] = torch.cat(got) if total else x
        note(f"{schedule}: {_regions(trace)}")
    for schedule, out in outs.items():
        assert relative_error(out, plain) <= 1e-5, schedule
    assert all(len(k._rendezvous) == 0 for k in model.kernels)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_merge_inputs_packs_every_ubatch_and_splits_back(data):
    """The merge itself (pure tensor code): the merged call sees every ubatch's valid rows, in
    ubatch order, with the summed counts; the split gives each ubatch its own rows back."""
    fmt = data.draw(st.sampled_from(list(ActivationFormat)), label="format")
    n = data.draw(st.integers(2, 4), label="ubatches")
    n_local = data.draw(st.integers(1, 4), label="local experts")
    host = data.draw(st.booleans(), label="host counts")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    inputs = []
    for u in range(n):
        rows = data.draw(st.integers(0, 6), label=f"rows[{u}]")
        counts = torch.tensor([data.draw(st.integers(0, rows)) for _ in range(n_local)],
                              dtype=torch.int32)
        meta = ExpertTokensMetadata(counts, counts.clone() if host or u else None)
        if fmt is ActivationFormat.BATCHED_EXPERTS:
            a1q = torch.randn(n_local, rows, 3, generator=g)
            scale = torch.randn(n_local, rows, 1, generator=g)
            inputs.append(merged_mod.ExpertsInput(a1q, scale, meta, None, None))
        else:
            a1q = torch.randn(rows, 3, generator=g)
            ids = torch.randint(-1, n_local, (rows, 2), generator=g)
            inputs.append(merged_mod.ExpertsInput(a1q, a1q[:, :1] * 2, meta, ids, torch.rand(rows, 2)))
    merged, split = merged_mod.merge_inputs(fmt, inputs)
    total = torch.stack([i.expert_tokens_meta.expert_num_tokens for i in inputs]).sum(0)
    assert torch.equal(merged.expert_tokens_meta.expert_num_tokens, total.to(torch.int32))
    assert (merged.expert_tokens_meta.expert_num_tokens_cpu is not None) == host
    parts = split(merged.a1q)
    assert [p.shape for p in parts] == [i.a1q.shape for i in inputs]
    if fmt is ActivationFormat.STANDARD:
        assert torch.equal(merged.a1q, torch.cat([i.a1q for i in inputs]))
        assert torch.equal(merged.topk_ids, torch.cat([i.topk_ids for i in inputs]))
        assert torch.equal(merged.a1q_scale, torch.cat([i.a1q_scale for i in inputs]))
        assert all(torch.equal(p, i.a1q) for p, i in zip(parts, inputs, strict=True))
        return
    assert merged.a1q.shape[1] == sum(i.a1q.shape[1] for i in inputs)
    for e in range(n_local):
        want = torch.cat([i.a1q[e, : int(i.expert_tokens_meta.expert_num_tokens[e])] for i in inputs])
        assert torch.equal(merged.a1q[e, : want.shape[0]], want)
        want_s = torch.cat([i.a1q_scale[e, : int(i.expert_tokens_meta.expert_num_tokens[e])]
                            for i in inputs])
        assert torch.equal(merged.a1q_scale[e, : want.shape[0]], want_s)
        for p, i in zip(parts, inputs, strict=True):
            c = int(i.expert_tokens_meta.expert_num_tokens[e])
            assert torch.equal(p[e, :c], i.a1q[e, :c])
