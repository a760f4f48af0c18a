"""dbo.overlap: the overlapped forward equals the plain one; fallbacks; merging; errors.

Every numerical test runs a small model that yields between its blocks (so ubatches really
interleave) and compares the overlapped output with the plain forward's.
"""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import dbo
from dbo.overlap import (
    DBOWrapper,
    UBatchInfo,
    current_num_valid_tokens,
    current_ubatch,
    mask_current_padding,
    overlapped_forward,
)
from dbo.split import (
    DISABLE_ENV_VAR,
    FALLBACK_LOG,
    SplitConfig,
    SplitReason,
    UBatchPlan,
    merge_outputs,
    no_split_plan,
    plan_ubatches,
    split_inputs,
)

# adaptive=False: every split call overlaps (the measured choice has tests of its own)
ALWAYS = SplitConfig(decode_token_threshold=0, prefill_token_threshold=0, adaptive=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matmuls: with two intra-op threads on a busy 2-core machine they spin for ms each
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV_VAR, raising=False)
    FALLBACK_LOG.reset()
    yield
    FALLBACK_LOG.reset()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class ToyMoELayer(torch.nn.Module):
    """Attention stand-in (two matmuls and a norm, yielding in between), then a top-k routed
    mixture of small experts whose padding rows must arrive with ``topk_ids == -1``."""

    def __init__(self, hidden: int, experts: int, topk: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.proj_in = torch.nn.Linear(hidden, 2 * hidden)
        self.proj_out = torch.nn.Linear(2 * hidden, hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.topk = topk
        self.routing_log: list[tuple[UBatchInfo | None, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(self.norm(x))
        dbo.dbo_yield()
        x = x + self.proj_out(torch.nn.functional.gelu(h))
        weights, ids = torch.topk(torch.softmax(self.router(x).float(), -1), self.topk)
        ids, weights = mask_current_padding(ids, weights)
        self.routing_log.append((current_ubatch(), ids))
        dbo.dbo_yield()  # where a real layer's dispatch would be in flight
        # dense stand-in for the experts: every expert on every row, weighted by the routing
        # (a -1 id contributes nothing)
        experts = self.w.shape[0]
        onehot = torch.nn.functional.one_hot(ids.clamp_min(0), experts) * (ids >= 0).unsqueeze(-1)
        combine = (onehot * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # [T, E]
        out = torch.einsum("te,th,ehk->tk", combine, x, self.w)
        dbo.dbo_yield()
        return x + out


class ToyModel(torch.nn.Module):
    def __init__(self, hidden=16, experts=4, topk=2, layers=2, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList(ToyMoELayer(hidden, experts, topk) for _ in range(layers))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ToyModel()


@given(
    num_tokens=st.integers(1, 48),
    n=st.integers(2, 3),
    multiple=st.sampled_from([1, 8]),
    by_requests=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_overlapped_equals_plain(model, num_tokens, n, multiple, by_requests, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 16, generator=g)
    counts = None
    if by_requests:
        cuts = sorted(torch.randint(0, num_tokens + 1, (3,), generator=g).tolist())
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens], strict=True)]
    cfg = SplitConfig(num_ubatches=n, pad_to_multiple=multiple, prefill_token_threshold=0,
                      mode="requests" if by_requests else "tokens")
    with torch.no_grad():
        ref = model(x)
        trace = dbo.Trace()
        for layer in model.layers:
            layer.routing_log.clear()
        plan = plan_ubatches(num_tokens, cfg, request_token_counts=counts)
        note(f"plan={plan}")
        out = overlapped_forward(model, x, plan=plan, trace=trace)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= 1e-5
    if not plan.split:
        return
    # padding rows routed to no expert; real rows did route
    for layer in model.layers:
        assert len(layer.routing_log) == n
        for info, ids in layer.routing_log:
            assert ids.shape[0] == plan.padded_size
            assert bool((ids[info.num_valid:] == -1).all())
            assert bool((ids[: info.num_valid] >= 0).all())
    # the ubatches interleaved: ubatch 1 ran before ubatch 0 finished
    kinds = [(e.kind, e.ubatch) for e in trace.events]
    assert kinds.index(("resume", 1)) < kinds.index(("finish", 0))


def test_overlapped_equals_plain_bf16():
    torch.manual_seed(1)
    model = ToyModel(dtype=torch.bfloat16)
    x = torch.randn(40, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        out = DBOWrapper(model, ALWAYS)(x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 2e-2


def test_token_offsets_and_ubatch_info():
    seen = []

    def fn(x):
        seen.append((dbo.dbo_current_ubatch_id(), dbo.dbo_current_ubatch_token_offset(),
                     current_ubatch(), current_num_valid_tokens(x.shape[0])))
        dbo.dbo_yield()
        assert current_ubatch() is seen[dbo.dbo_current_ubatch_id()][2]  # no leak across ubatches
        return x + 1

    x = torch.arange(10.0).unsqueeze(1)
    cfg = SplitConfig(prefill_token_threshold=0, pad_to_multiple=8)
    out = overlapped_forward(fn, x, config=cfg)
    assert torch.equal(out, x + 1)
    assert [(i, off) for i, off, _, _ in seen] == [(0, 0), (1, 5)]
    assert seen[0][2] == UBatchInfo(0, 2, 0, 5, 8) and seen[0][3] == 5
    assert current_ubatch() is None and current_num_valid_tokens(7) == 7


def test_padded_inputs_are_zero_and_outputs_drop_padding():
    got = []

    def fn(x, ids):
        got.append((x.clone(), ids.clone()))
        return x * 2, ids

    x = torch.arange(1.0, 8.0).unsqueeze(1)
    ids = torch.arange(7)
    plan = UBatchPlan(7, ((0, 4), (4, 7)), 6, SplitReason.SPLIT)
    out, out_ids = overlapped_forward(fn, x, ids, plan=plan)
    assert torch.equal(out, x * 2) and torch.equal(out_ids, ids)
    assert got[0][0].shape == (6, 1) and bool((got[0][0][4:] == 0).all())
    assert bool((got[1][0][3:] == 0).all()) and got[1][1].dtype == ids.dtype


def test_empty_rank_runs_padding_only():
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        return x + 1

    plan = UBatchPlan(0, ((0, 0), (0, 0)), 4, SplitReason.SPLIT)
    out = overlapped_forward(fn, torch.zeros(0, 3), plan=plan)
    assert calls == [4, 4] and out.shape == (0, 3)


def test_structured_outputs():
    Pair = namedtuple("Pair", "a b")

    def fn(x):
        dbo.dbo_yield()
        return {"t": (x, [x * 2, None]), "p": Pair(x + 1, x.sum(1))}

    x = torch.randn(9, 3)
    out = overlapped_forward(fn, x, config=ALWAYS)
    ref = fn(x)
    assert isinstance(out["p"], Pair) and isinstance(out["t"], tuple) and isinstance(out["t"][1], list)
    assert torch.equal(out["t"][0], ref["t"][0]) and out["t"][1][1] is None
    assert torch.equal(out["t"][1][0], ref["t"][1][0])
    assert torch.equal(out["p"].a, ref["p"].a) and torch.allclose(out["p"].b, ref["p"].b)


def test_split_and_merge_round_trip():
    plan = UBatchPlan(5, ((0, 3), (3, 5)), 4, SplitReason.SPLIT)
    x = torch.randn(5, 2)
    parts = split_inputs(plan, [x])
    assert [p[0].shape[0] for p in parts] == [4, 4]
    assert torch.equal(merge_outputs(plan, [p[0] for p in parts]), x)


# ---- fallbacks -----------------------------------------------------------------------------


class CountingFn:
    def __init__(self):
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, x):
        self.calls.append((x.shape[0], dbo.dbo_enabled()))
        return x * 3


def test_below_threshold_runs_plain_and_logs_once(caplog):
    caplog.set_level(logging.INFO, logger="dbo.split")
    fn = CountingFn()
    x = torch.randn(20, 4)
    wrapper = DBOWrapper(fn, SplitConfig(prefill_token_threshold=64, adaptive=False))
    for _ in range(3):
        assert torch.equal(wrapper(x), x * 3)
    assert fn.calls == [(20, False)] * 3
    assert wrapper.last_plan.reason is SplitReason.BELOW_THRESHOLD
    msgs = [r.getMessage() for r in caplog.records if r.name == "dbo.split"]
    assert len(msgs) == 1 and "below_threshold" in msgs[0]


def test_env_var_switches_overlap_off(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dbo.split")
    fn = CountingFn()
    x = torch.randn(20, 4)
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    assert torch.equal(overlapped_forward(fn, x, config=ALWAYS), x * 3)
    assert torch.equal(overlapped_forward(fn, x, config=ALWAYS), x * 3)
    assert fn.calls == [(20, False)] * 2
    msgs = [r.getMessage() for r in caplog.records if r.name == "dbo.split"]
    assert len(msgs) == 1 and "disabled" in msgs[0] and DISABLE_ENV_VAR in msgs[0]
    monkeypatch.delenv(DISABLE_ENV_VAR)
    fn.calls.clear()
    overlapped_forward(fn, x, config=ALWAYS)
    assert fn.calls == [(10, True), (10, True)]


def test_config_switches_overlap_off():
    fn = CountingFn()
    out = overlapped_forward(fn, torch.ones(50, 2), config=SplitConfig(enabled=False))
    assert fn.calls == [(50, False)] and torch.equal(out, torch.full((50, 2), 3.0))


def test_given_no_split_plan_runs_plain():
    fn = CountingFn()
    overlapped_forward(fn, torch.ones(6, 2), plan=no_split_plan(6, SplitReason.DISAGREEMENT))
    assert fn.calls == [(6, False)]


# ---- the wrapper and errors ----------------------------------------------------------------


def test_wrapper_registers_module_and_passes_kwargs():
    lin = torch.nn.Linear(4, 4)
    seen = []

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x, *, scale):
            seen.append(scale)
            return self.lin(x) * scale

    w = DBOWrapper(M(), ALWAYS, trace=dbo.Trace())
    assert any(p is lin.weight for p in w.parameters())
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert torch.allclose(w(x, scale=2.0), lin(x) * 2.0, rtol=1e-6, atol=1e-6)
    assert seen == [2.0, 2.0] and w.last_plan.split
    assert any(e.kind == "run_begin" for e in w.trace.events)
    with pytest.raises(TypeError, match="callable"):
        DBOWrapper(3)


def test_input_errors():
    with pytest.raises(ValueError, match="at least one"):
        overlapped_forward(lambda: None)
    with pytest.raises(ValueError, match="rows"):
        overlapped_forward(lambda a, b: a, torch.zeros(4, 2), torch.zeros(5, 2), config=ALWAYS)
    with pytest.raises(TypeError, match="fn_kwargs"):
        overlapped_forward(lambda a, b: a, torch.zeros(4, 2), 3, config=ALWAYS)
    with pytest.raises(ValueError, match="scalar"):
        overlapped_forward(lambda a: a, torch.tensor(1.0), config=ALWAYS)
    plan = plan_ubatches(8, ALWAYS)
    with pytest.raises(ValueError, match="plan is for 8"):
        overlapped_forward(lambda a: a, torch.zeros(4, 2), plan=plan)


def test_output_errors():
    with pytest.raises(TypeError, match="not token-major"):
        overlapped_forward(lambda a: a.sum(), torch.zeros(8, 2), config=ALWAYS)
    with pytest.raises(TypeError, match="cannot merge"):
        overlapped_forward(lambda a: "x", torch.zeros(8, 2), config=ALWAYS)


def test_ubatch_failure_surfaces_as_ubatch_error():
    def fn(x):
        dbo.dbo_yield()
        if dbo.dbo_current_ubatch_id() == 1:
            raise RuntimeError("boom")
        return x

    with pytest.raises(dbo.UBatchError) as info:
        overlapped_forward(fn, torch.zeros(8, 2), config=ALWAYS)
    assert info.value.ubatch_id == 1 and isinstance(info.value.__cause__, RuntimeError)
    assert current_ubatch() is None


# ---- SM carve-out ------------------------------------------------------------------------


def _carveout() -> int | None:
    return torch._C._get_sm_carveout_experimental()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sm_carveout_applies_inside_overlapped_calls_only():
    seen = []

    def fn(x):
        seen.append((dbo.dbo_enabled(), _carveout()))
        dbo.dbo_yield()
        seen.append((dbo.dbo_enabled(), _carveout()))
        return x * 2

    before = _carveout()
    x = torch.arange(16.0).reshape(8, 2)
    out = overlapped_forward(fn, x, config=ALWAYS, sm_carveout=16)
    assert torch.equal(out, x * 2) and _carveout() == before
    assert seen and all(s == (True, 16) for s in seen)
    seen.clear()
    wrapped = DBOWrapper(fn, SplitConfig(enabled=False), sm_carveout=16)
    assert torch.equal(wrapped(x), x * 2) and seen == [(False, before), (False, before)]
    seen.clear()
    assert torch.equal(DBOWrapper(fn, ALWAYS, sm_carveout=8)(x), x * 2)
    assert {s[1] for s in seen} == {8} and _carveout() == before


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sm_carveout_is_restored_when_a_ubatch_fails():
    def fn(x):
        dbo.dbo_yield()
        raise RuntimeError("boom")

    before = _carveout()
    with pytest.raises(dbo.UBatchError):
        overlapped_forward(fn, torch.zeros(8, 2), config=ALWAYS, sm_carveout=4)
    assert _carveout() == before


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_sm_carveout_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="sm_carveout"):
        overlapped_forward(lambda x: x, torch.zeros(8, 2), config=ALWAYS, sm_carveout=bad)
    with pytest.raises(ValueError, match="sm_carveout"):
        DBOWrapper(lambda x: x, ALWAYS, sm_carveout=bad)


class _CostClock:
    """A clock the forward below advances: `plain_ms` for a plain call, `ubatch_ms` per ubatch."""

    def __init__(self, plain_ms: float, ubatch_ms: float):
        self.now, self.plain_ms, self.ubatch_ms = 0.0, plain_ms, ubatch_ms

    def __call__(self) -> float:
        return self.now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += (self.plain_ms if current_ubatch() is None else self.ubatch_ms) / 1e3
        return x * 3.0


@pytest.mark.parametrize("ubatch_ms, kept", [(3.0, "split"), (6.0, "plain")])
def test_an_untuned_wrapper_keeps_what_it_measured_faster(ubatch_ms, kept):
    from dbo.split.online import OnlineChoice

    clock = _CostClock(plain_ms=10.0, ubatch_ms=ubatch_ms)  # two ubatches: 6 or 12 ms a call
    wrapper = DBOWrapper(clock.forward, SplitConfig(prefill_token_threshold=8), agree=False)
    assert wrapper.config.adaptive
    wrapper.online = OnlineChoice(("plain", "split"), trials=2, clock=clock, agree=False)
    x = torch.randn(16, 4)
    seen = []
    for _ in range(wrapper.online.calls_to_decide + 3):
        assert torch.equal(wrapper(x), x * 3.0)  # every call, whichever way it ran
        seen.append(wrapper.last_plan.split)
    # a block per candidate (its warm-up call, then its trials): plain, then split
    assert seen[:6] == [False] * 3 + [True] * 3
    plan = wrapper.plan(16)
    assert wrapper.online.choice(plan).value == kept
    assert seen[-3:] == [kept == "split"] * 3
    if kept == "plain":
        assert wrapper.last_plan.reason is SplitReason.MEASURED


def test_an_adaptive_wrapper_says_while_it_measures_which_bucket_and_call(caplog):
    clock = _CostClock(plain_ms=10.0, ubatch_ms=3.0)
    wrapper = DBOWrapper(clock.forward, SplitConfig(prefill_token_threshold=8), agree=False)
    x = torch.randn(16, 4)
    wrapper(x)  # the default candidates: four blocks of a warm-up and three timed calls
    assert wrapper.online.calls_to_decide == 16
    assert wrapper.last_plan.reason is SplitReason.MEASURING
    assert wrapper.last_plan.detail == "measuring ~16 tokens: call 1 of 16, plain (warm-up)"
    for _ in range(4):
        wrapper(x)
    assert wrapper.last_plan.split
    assert wrapper.last_plan.detail == "measuring ~16 tokens: call 5 of 16, split (warm-up)"
    assert "plain" in wrapper.online.table() and "measuring (call 5 of 16)" in wrapper.online.table()
    with caplog.at_level(logging.WARNING, logger="dbo.split.online"):
        for _ in range(11):
            wrapper(x)
    assert [r.getMessage()[:13] for r in caplog.records] == ["dbo chose ~16"]
    assert "measuring" not in wrapper.online.table()
    wrapper(x)
    assert "measured fastest" in wrapper.last_plan.detail


def test_an_adaptive_wrapper_given_a_plan_runs_it_as_it_is():
    wrapper = DBOWrapper(lambda x: x + 1, SplitConfig(prefill_token_threshold=8), agree=False)
    x = torch.randn(16, 4)
    plan = wrapper.plan(16)
    assert plan.split
    for _ in range(3):
        assert torch.equal(wrapper(x, plan=plan), x + 1)
        assert wrapper.last_plan is plan
    assert wrapper.online is None


def test_run_options_are_one_checked_value_that_the_wrapper_attributes_replace():
    from dbo import RunOptions

    with pytest.raises(ValueError):
        RunOptions(sm_carveout=-1)
    with pytest.raises((ValueError, TypeError)):
        RunOptions(timeout_s=0)
    with pytest.raises((ValueError, TypeError)):
        RunOptions(compute_sms=0)
    trace = dbo.Trace()
    wrapped = DBOWrapper(lambda h: h * 2, trace=trace, sm_carveout=4, timeout_s=5.0)
    assert wrapped.options == RunOptions(trace=trace, sm_carveout=4, timeout_s=5.0)
    wrapped.sm_carveout = None
    wrapped.timeout_s = 2.0
    assert wrapped.options == RunOptions(trace=trace, timeout_s=2.0)
    with pytest.raises(ValueError):
        wrapped.sm_carveout = -3
    assert wrapped.options.sm_carveout is None  # a refused value leaves the options as they were
    with pytest.raises(ValueError):
        overlapped_forward(lambda h: h, torch.zeros(4, 2), sm_carveout=-1)
