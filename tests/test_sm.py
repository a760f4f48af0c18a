"""The SM carve-out travels one way: from the overlapped forward's run to every experts object it
calls (a context variable, wherever the model keeps them), from the experts to the fused kernels'
launches as an argument, and from there to the persistent grid's size.

CPU only: the launches are replaced by recorders (the GPU side, a persistent grid of ``SMs - N``
programs, is :func:`persistent_grid`'s arithmetic, checked here on a stand-in device).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dbo
from dbo import DBOWrapper, overlapped_forward
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.experts import SwiGLUExperts, make_expert_weights
from dbo.experts import swiglu as experts_mod
from dbo.experts.kernels import batched, fused_experts
from dbo.experts.reference import reference_moe, relative_error
from dbo.experts.swiglu import find_swiglu_experts
from dbo.moe import ActivationFormat, MoEKernel, Workspace, topk_route
from dbo.overlap import mask_current_padding
from dbo.split import SplitConfig
from dbo.ubatch.sm import check_compute_sms, check_sm_carveout, sm_carveout

ALWAYS = SplitConfig(decode_token_threshold=0, prefill_token_threshold=0, adaptive=False)
H100 = SimpleNamespace(multi_processor_count=132)


def torch_carveout() -> int | None:
    return torch._C._get_sm_carveout_experimental()


# ---- the checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_bad_carveouts_are_value_errors_at_every_entry(bad):
    with pytest.raises(ValueError, match="sm_carveout must be a non-negative int"):
        check_sm_carveout(bad)
    with pytest.raises(ValueError, match="sm_carveout"):
        SwiGLUExperts(sm_carveout=bad)
    wrapper = DBOWrapper(lambda x: x, ALWAYS)
    with pytest.raises(ValueError, match="sm_carveout"):
        wrapper.sm_carveout = bad
    with pytest.raises(ValueError, match="compute_sms"):
        wrapper.compute_sms = 0
    with pytest.raises(ValueError, match="sm_carveout"), sm_carveout(bad):
        pass
    assert check_sm_carveout(0) == 0 and check_sm_carveout(None) is None
    assert check_compute_sms(1) == 1 and check_compute_sms(None) is None


def test_sm_carveout_block_sets_and_restores_torchs_setting():
    before = torch_carveout()
    with sm_carveout(12):
        assert torch_carveout() == 12
    assert torch_carveout() == before
    with sm_carveout(None):
        assert torch_carveout() == before


# ---- the grid ------------------------------------------------------------------------------


def test_persistent_grids_leave_the_carveout_free():
    # a persistent grid over every SM would keep them all until its last tile; with a carve-out
    # it spreads over the others
    assert fused_experts.resident_sms(H100, None) == 132
    assert fused_experts.resident_sms(H100, 0) == 132
    assert fused_experts.resident_sms(H100, 8) == 124
    assert fused_experts.resident_sms(H100, 500) == 1
    assert fused_experts.persistent_grid(10_000, H100, 2, 8) == 248
    assert fused_experts.persistent_grid(10_000, H100, 2, None) == 264
    assert fused_experts.persistent_grid(100, H100, 2, 8) == 100  # no more programs than tiles
    assert fused_experts.persistent_grid(0, H100, 2, 8) == 1


# ---- the launches --------------------------------------------------------------------------


def _record_launches(monkeypatch, module) -> list[tuple[str, int | None]]:
    seen: list[tuple[str, int | None]] = []
    monkeypatch.setattr(module, "launch_gate_up",
                        lambda *a, sm_carveout=None, **k: seen.append(("gate_up", sm_carveout)))
    monkeypatch.setattr(module, "launch_down",
                        lambda *a, sm_carveout=None, **k: seen.append(("down", sm_carveout)) or False)
    return seen


def _routed(m: int = 12, e: int = 4, topk: int = 2, hidden: int = 16, inter: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    weights, ids = topk_route(torch.randn(m, e, generator=g), topk)
    w1, w2 = make_expert_weights(e, hidden, inter, seed=seed)
    return x, weights, ids, w1, w2


@pytest.mark.parametrize("carve", [None, 16])
def test_fused_experts_pass_the_carveout_to_both_launches(monkeypatch, carve):
    seen = _record_launches(monkeypatch, fused_experts)
    monkeypatch.setattr(fused_experts, "launch_topk_sum", lambda *a, **k: None)
    monkeypatch.setattr(fused_experts, "route_order", lambda ids, n, bounds=None: (
        torch.zeros(ids.numel(), dtype=torch.int32), torch.zeros(n, dtype=torch.int32)))
    x, weights, ids, w1, w2 = _routed()
    fused_experts.fused_swiglu_experts(x, w1, w2, weights, ids, out=torch.empty_like(x),
                                       sm_carveout=carve)
    assert seen == [("gate_up", carve), ("down", carve)]


def test_batched_experts_pass_the_carveout_to_both_launches(monkeypatch):
    seen = _record_launches(monkeypatch, batched)
    monkeypatch.setattr(batched, "batched_order", lambda counts, cap: (
        torch.zeros(counts.numel() * cap, dtype=torch.int32), torch.zeros(counts.numel(), dtype=torch.int32)))
    x = torch.zeros(4, 8, 16)
    w1, w2 = make_expert_weights(4, 16, 8)
    batched.batched_swiglu_experts(x, w1, w2, torch.ones(4, dtype=torch.int32), out=torch.empty_like(x),
                                   sm_carveout=6)
    assert seen == [("gate_up", 6), ("down", 6)]


# ---- the experts, and the overlapped forward that sets theirs ------------------------------


class _Recorder:
    """Stands in for ``fused_swiglu_experts`` in :mod:`dbo.experts.swiglu`: notes the carve-out
    and whether a run is active, and computes the experts with the float32 reference."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int | None, int | None]] = []

    def __call__(self, x, w1, w2, weights, ids, *, out, sm_carveout=None, **kwargs):
        self.seen.append((dbo.dbo_enabled(), sm_carveout, torch_carveout()))
        return out.copy_(reference_moe(x, w1, w2, weights, ids))


class _MoEModel(torch.nn.Module):
    """A residual MoE layer on the library's kernel (experts kept where dbo's layers keep them)."""

    def __init__(self, experts: SwiGLUExperts, e: int = 4, hidden: int = 16, topk: int = 2):
        super().__init__()
        self.kernel = MoEKernel(LocalPrepareAndFinalize(), experts)
        self.w1, self.w2 = make_expert_weights(e, hidden, 8, seed=1)
        self.gate = torch.randn(e, hidden, generator=torch.Generator().manual_seed(2))
        self.e, self.topk = e, topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_route(x @ self.gate.t(), self.topk)
        ids, weights = mask_current_padding(ids, weights)
        return x + self.kernel(x, self.w1, self.w2, weights, ids, global_num_experts=self.e)


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    """The fused kernels replaced by a recorder: with no launch left, Triton is not needed, so
    the experts' check for it (``use_triton=True`` raises where it is not importable) is
    answered yes, as on a machine that has it."""
    rec = _Recorder()
    monkeypatch.setattr(experts_mod, "fused_swiglu_experts", rec)
    monkeypatch.setattr(experts_mod, "use_triton_for", lambda t, use_triton=None: bool(use_triton))
    return rec


def test_experts_pass_their_carveout_to_the_fused_kernels(recorder):
    x, weights, ids, w1, w2 = _routed()
    for carve in (None, 10):
        SwiGLUExperts(use_triton=True, fused=True, sm_carveout=carve).apply(
            x, w1, w2, weights, ids, activation_format=ActivationFormat.STANDARD,
            expert_tokens_meta=None, apply_router_weight_on_input=False, workspace=Workspace())
    assert [s[1] for s in recorder.seen] == [None, 10]


def test_overlapped_calls_set_the_carveout_on_the_models_experts_and_restore_it(recorder):
    experts = SwiGLUExperts(use_triton=True, fused=True, sm_carveout=2)
    model = _MoEModel(experts)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))
    plain = model(x)
    assert recorder.seen == [(False, 2, torch_carveout())]
    before = torch_carveout()
    recorder.seen.clear()

    out = overlapped_forward(model, x, config=ALWAYS, agree=False, sm_carveout=16)
    assert relative_error(out, plain) < 1e-6
    assert recorder.seen == [(True, 16, 16)] * 2  # each ubatch's experts, and cuBLAS's
    assert experts.sm_carveout == 2 and torch_carveout() == before

    recorder.seen.clear()
    wrapped = DBOWrapper(model, ALWAYS, agree=False, sm_carveout=8)
    assert relative_error(wrapped(x), plain) < 1e-6
    wrapped.sm_carveout = None  # as DBOPrefill.autotune sets the tuned value
    assert relative_error(wrapped(x), plain) < 1e-6
    assert recorder.seen == [(True, 8, 8)] * 2 + [(True, 2, before)] * 2
    assert experts.sm_carveout == 2 and torch_carveout() == before


def test_the_carveout_is_restored_when_a_ubatch_fails(recorder):
    class Failing(_MoEModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            if dbo.dbo_current_ubatch_id() == 1:
                raise RuntimeError("boom")
            return y

    experts = SwiGLUExperts(use_triton=True, fused=True)
    before = torch_carveout()
    with pytest.raises(dbo.UBatchError):
        overlapped_forward(Failing(experts), torch.randn(8, 16), config=ALWAYS, agree=False,
                           sm_carveout=4)
    assert [s[1] for s in recorder.seen] == [4, 4]
    assert experts.sm_carveout is None and torch_carveout() == before


def test_experts_two_levels_below_an_attribute_get_the_runs_carveout(recorder):
    # the model keeps its MoE layer inside a plain object inside another: no search of its
    # modules finds the experts, and the run's carve-out reaches them all the same
    experts = SwiGLUExperts(use_triton=True, fused=True)
    layer = _MoEModel(experts)

    class Deep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = SimpleNamespace(blocks=[SimpleNamespace(moe=layer.forward)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stack.blocks[0].moe(x)

    model = Deep()
    assert find_swiglu_experts(model) == []
    before = torch_carveout()
    out = overlapped_forward(model, torch.randn(8, 16), config=ALWAYS, agree=False, sm_carveout=16)
    assert out.shape == (8, 16)
    assert recorder.seen == [(True, 16, 16)] * 2
    assert experts.sm_carveout is None and torch_carveout() == before


def test_find_swiglu_experts_where_dbos_layers_keep_them():
    a, b = SwiGLUExperts(), SwiGLUExperts()
    model = torch.nn.Sequential(_MoEModel(a), _MoEModel(b), _MoEModel(a))
    assert find_swiglu_experts(model) == [a, b]
    assert find_swiglu_experts(model[1].forward) == [b]  # a bound method: its module
    # an object that is not a module (the benchmark's model): its attributes, lists included
    holder = SimpleNamespace(kernels=[model[0].kernel, model[1].kernel], other=3)
    assert find_swiglu_experts(holder) == [a, b]
    # an object holding the experts as `.experts` (the transformers expert-parallel layer)
    layer = torch.nn.Linear(2, 2)
    layer.impl = SimpleNamespace(experts=b)
    assert find_swiglu_experts(layer) == [b]
    assert find_swiglu_experts(lambda x: model(x)) == []
