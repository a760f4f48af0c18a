"""The experts that run in dbo's expert-parallel implementations: dbo's library experts on the
model's own weights, or the experts module's own forward.

On 2 gloo ranks, a tiny Qwen3-MoE checkpoint loaded with ``ep_distributed_config(backend)``
for each CPU backend (naive, all2all, copy_engine), each rank its own batch with left padding,
float32: the library experts (the default for this layout) give the unsharded model's logits,
plain and overlapped (``DBOPrefill``, the ubatches interleave), and the same logits as the
model's own experts on the same loaded model (switched with ``switch_ep_experts``) and on a
model loaded with ``experts="model"``. In one process: the library experts equal the module's
own forward for Qwen3-MoE, Mixtral and DeepSeek-V3 in both activation formats, on the module's
weights (no copy); layouts they cannot run are refused with the reason; the choice's API.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
ep_module = pytest.importorskip("transformers.distributed.expert_parallel",
                                reason="transformers < 5.23 has no EP implementation interface")

pytestmark = [pytest.mark.timeout(240), pytest.mark.dist_world(pg_timeout_s=60.0)]

BACKENDS = ("naive", "all2all", "copy_engine")
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
TOL = 1e-5   # float32, against the unsharded model, relative to the largest logit of real tokens
SAME = 1e-6  # the same loaded model: overlapped against plain, library against the model's experts


def _tiny_model(family: str, seed: int):
    from dbo.integrations.transformers.presets import tiny_random_model

    return tiny_random_model(family, seed)


def _experts_module(family: str, seed: int = 0):
    model = _tiny_model(family, seed)
    return next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))


# ---- 2 ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen3_checkpoint):
    return tiny_qwen3_checkpoint


def _inputs(rank: int):
    from dbo.testing.hf import left_padded_prompts

    return left_padded_prompts(23 + rank, ((0, 3, 0), (2, 0, 0, 5, 1))[rank], 6)  # padding per rank


def _load(path: str, backend: str | None, **experts):
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.testing.hf import load_float32

    return load_float32(path, None if backend is None else ep_distributed_config(backend, **experts))


def _choice_job(path: str, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    import dbo
    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.ep import LibraryExperts, ModelExperts, UnsupportedEPError
    from dbo.integrations.transformers.ep_model import ep_experts, expert_parallel_modules, switch_ep_experts

    ids, mask = _inputs(dist.get_rank())
    valid = mask.bool()
    with torch.no_grad():
        want = prefill_logits(_load(path, None), ids, mask, mask_padding_tokens=False)

    def rel(a, b):
        return ((a - b)[valid].abs().max() / b[valid].abs().max()).item()

    calls = {LibraryExperts: 0, ModelExperts: 0}
    applies = {cls: cls.apply for cls in calls}

    def counted(cls):
        def apply(self, *args, **kwargs):
            calls[cls] += 1
            return applies[cls](self, *args, **kwargs)
        return apply

    def run(model):
        trace = dbo.Trace()
        for cls in calls:
            calls[cls] = 0
            cls.apply = counted(cls)
        try:
            with torch.inference_mode():
                prefill = DBOPrefill(model, prefill_split_config(adaptive=False), trace=trace)
                overlapped = prefill(ids, mask)
                plain = prefill_logits(model, ids, mask)
        finally:
            for cls, apply in applies.items():
                cls.apply = apply
        interleaved = ("resume", 1, "") in [(e.kind, e.ubatch, e.detail) for e in trace.events]
        return plain, overlapped, prefill.last_plan.split and interleaved

    def kernels_run(model, cls):
        # every layer's kernel runs that class, and only it ran: 2 layers x (2 ubatches + plain)
        other = ModelExperts if cls is LibraryExperts else LibraryExperts
        return calls[cls] == 6 and calls[other] == 0 and all(
            isinstance(impl.experts, cls) and impl.kernel.experts is impl.experts
            for _, impl in expert_parallel_modules(model))

    out = {}
    model = _load(path, backend)  # the default: the library experts, where the layout allows
    out["default"] = ep_experts(model)
    lib_plain, lib_dbo, lib_split = run(model)
    out["library_ran"] = kernels_run(model, LibraryExperts)
    switch_ep_experts(model, "model")
    out["switched"] = ep_experts(model)
    own_plain, own_dbo, own_split = run(model)
    out["model_ran"] = kernels_run(model, ModelExperts)
    # a layout the library experts cannot run: refused, and no layer switched
    impl = expert_parallel_modules(model)[-1][1]
    impl._module.act_fn = torch.nn.GELU()
    try:
        switch_ep_experts(model, "library")
        out["refused"] = None
    except UnsupportedEPError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = ep_experts(model)
    loaded_own = _load(path, backend, experts="model")
    out["loaded_model"] = ep_experts(loaded_own)
    loaded_plain, loaded_dbo, loaded_split = run(loaded_own)
    out["loaded_model_ran"] = kernels_run(loaded_own, ModelExperts)
    out["split"] = (lib_split, own_split, loaded_split)
    out["err"] = {
        "library_plain": rel(lib_plain, want), "library_dbo": rel(lib_dbo, want),
        "model_plain": rel(own_plain, want), "model_dbo": rel(own_dbo, want),
        "loaded_model_plain": rel(loaded_plain, want), "loaded_model_dbo": rel(loaded_dbo, want),
    }
    out["same"] = {
        "library_dbo_vs_plain": rel(lib_dbo, lib_plain), "model_dbo_vs_plain": rel(own_dbo, own_plain),
        "loaded_dbo_vs_plain": rel(loaded_dbo, loaded_plain),
        "library_vs_model_plain": rel(lib_plain, own_plain), "library_vs_model_dbo": rel(lib_dbo, own_dbo),
        "switched_vs_loaded": rel(own_plain, loaded_plain),
    }
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_library_experts_equal_model_experts_and_unsharded(world2, checkpoint, backend):
    for rank, r in enumerate(world2.run(_choice_job, checkpoint, backend, timeout_s=180)):
        where = f"rank {rank} dbo_{backend}: {r}"
        layers = list(r["default"])
        assert len(layers) == 2 and all(name.endswith("mlp.experts") for name in layers), where
        assert set(r["default"].values()) == {"library"} and r["library_ran"], where
        assert set(r["switched"].values()) == {"model"} and r["model_ran"], where
        assert set(r["loaded_model"].values()) == {"model"} and r["loaded_model_ran"], where
        assert r["split"] == (True, True, True), f"{where}: the ubatches did not overlap"
        assert all(e <= TOL for e in r["err"].values()), where
        assert all(e <= SAME for e in r["same"].values()), where
        assert r["refused"] is not None and "Qwen3MoeExperts" in r["refused"], where
        assert "GELU" in r["refused"] and "experts='model'" in r["refused"], where
        assert r["after_refusal"] == r["switched"], where


# ---- one process ---------------------------------------------------------------------------


def _slot_sum(experts, x, ids, weights):
    # the reference: each local slot through the module's own forward alone, weighted, summed
    import torch

    ones = torch.ones(x.shape[0], 1)
    with torch.no_grad():
        return sum(torch.where((ids[:, k] >= 0).unsqueeze(1), weights[:, k:k + 1] * experts(
            x, ids[:, k:k + 1].clamp(min=0), ones), 0.0) for k in range(ids.shape[1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_library_experts_equal_the_module_forward_on_its_weights(family, monkeypatch):
    import torch

    from dbo.experts import SwiGLUExperts
    from dbo.integrations.transformers.experts import LibraryExperts, library_layout_problem
    from dbo.moe import ActivationFormat, ExpertTokensMetadata, Workspace

    experts = _experts_module(family, 2)
    e, two_i, hidden = experts.gate_up_proj.shape
    assert tuple(experts.down_proj.shape) == (e, hidden, two_i // 2)  # [E, 2I, H], [E, H, I]
    assert library_layout_problem(experts) is None
    seen = []
    real_apply = SwiGLUExperts.apply

    def spy(self, x, w1, w2, *args, **kwargs):
        seen.append((w1.data_ptr(), w2.data_ptr()))
        return real_apply(self, x, w1, w2, *args, **kwargs)

    monkeypatch.setattr(SwiGLUExperts, "apply", spy)
    lib = LibraryExperts(experts)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, hidden, generator=g)
    ids = torch.tensor([[0, 3], [1, -1], [3, 7], [-1, -1], [5, 0], [2, 6], [-1, 4]])
    weights = torch.rand(7, 2, generator=g)
    kw = dict(expert_tokens_meta=None, apply_router_weight_on_input=False, workspace=Workspace())
    got = lib.apply(x, None, None, weights, ids, activation_format=ActivationFormat.STANDARD, **kw)
    torch.testing.assert_close(got, _slot_sum(experts, x, ids, weights), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[3], torch.zeros(hidden))  # no local slot: nothing computed
    # the module's own tensors, not copies
    assert seen == [(experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr())]
    # BATCHED_EXPERTS (deepep_ll): expert j's slab holds its tokens at the front, unweighted
    slabs = torch.zeros(e, 4, hidden)
    counts = torch.zeros(e, dtype=torch.int32)
    for t, k in (ids >= 0).nonzero().tolist():
        j = int(ids[t, k])
        slabs[j, counts[j]] = x[t]
        counts[j] += 1
    kw["expert_tokens_meta"] = ExpertTokensMetadata(counts)
    out = lib.apply(slabs, None, None, None, None, activation_format=ActivationFormat.BATCHED_EXPERTS,
                    **kw)
    for j in range(e):
        n = int(counts[j])
        with torch.no_grad():
            want = experts(slabs[j, :n], torch.full((n, 1), j), torch.ones(n, 1))
        torch.testing.assert_close(out[j, :n], want, rtol=1e-5, atol=1e-6)


def _gpt_oss_experts():
    # a transformers family the library experts cannot run: transposed, interleaved, biases
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=8, vocab_size=32))


def _mutated(change: str):
    import torch

    experts = _experts_module("qwen3_moe")
    if change == "gelu":
        experts.act_fn = torch.nn.GELU()
    elif change == "transposed":
        experts.is_transposed = True
    elif change == "bias":
        experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(8, 32))
    elif change == "own_gate":
        experts.__class__ = type("ClampedExperts", (type(experts),),
                                 {"_apply_gate": lambda self, h: h[..., ::2]})
    elif change == "undeclared":
        del experts.is_transposed
    return experts


@pytest.mark.parametrize("case, reason", [
    ("gelu", "activation is GELU, not silu"),
    ("transposed", r"stored transposed \(gate_up_proj \[E, hidden, 2I\]"),
    ("bias", "besides gate_up_proj and down_proj: gate_up_proj_bias"),
    ("own_gate", r"its own ClampedExperts._apply_gate, not silu\(gate\) \* up"),
    ("undeclared", "does not declare its weight layout"),
    ("gpt_oss", "GptOssExperts: its weights are stored transposed"),
])
def test_layouts_the_library_experts_cannot_run_are_refused(case, reason):
    from dbo.integrations.transformers.experts import (
        LibraryExperts,
        ModelExperts,
        UnsupportedEPError,
        make_experts,
    )

    experts = _gpt_oss_experts() if case == "gpt_oss" else _mutated(case)
    with pytest.raises(UnsupportedEPError, match=reason) as info:
        LibraryExperts(experts)
    assert "dbo's library experts cannot run" in str(info.value)
    assert "experts='model'" in str(info.value)
    with pytest.raises(UnsupportedEPError, match=reason):
        make_experts(experts, experts.forward, "library")
    fallback, kind = make_experts(experts, experts.forward, "auto")  # the module's own forward
    assert isinstance(fallback, ModelExperts) and kind == "model"


def test_choice_api_and_mistakes():
    from dbo.integrations.transformers.ep import (
        EXPERTS_CHOICES,
        DBOExpertParallel,
        ep_distributed_config,
        register_ep_implementation,
    )
    from dbo.integrations.transformers.ep_model import ep_experts, switch_ep_experts
    from dbo.integrations.transformers.experts import LibraryExperts, ModelExperts, make_experts

    assert EXPERTS_CHOICES == ("auto", "library", "model")
    names = ep_module.EPImplementationInterface()
    assert ep_distributed_config("all2all", world_size=2).ep_implementation == "dbo_all2all"
    assert ep_distributed_config("all2all", world_size=2, experts="auto").ep_implementation == "dbo_all2all"
    assert names["dbo_all2all"].experts_choice == "auto"
    for choice in ("library", "model"):
        cfg = ep_distributed_config("deepep_ll", world_size=2, experts=choice)
        cls = names[cfg.ep_implementation]
        assert cfg.ep_implementation == f"dbo_deepep_ll:{choice}"
        assert issubclass(cls, DBOExpertParallel) and cls.experts_choice == choice
        assert cls.backend == "deepep_ll" and cls.backend_kwargs == {"max_tokens_per_rank": 256}
    assert register_ep_implementation("dbo_test_own", "naive", experts="model") == "dbo_test_own"
    assert names["dbo_test_own"].experts_choice == "model"
    assert ep_distributed_config("dbo_test_own", world_size=2).ep_implementation == "dbo_test_own"
    assert ep_distributed_config("dbo_test_own", world_size=2, experts="model").ep_implementation \
        == "dbo_test_own"
    # a derived name given back: None keeps its choice, another choice goes to its base's
    assert ep_distributed_config("all2all", world_size=2, experts="model").ep_implementation \
        == "dbo_all2all:model"
    assert ep_distributed_config("dbo_all2all:model", world_size=2).ep_implementation == "dbo_all2all:model"
    assert ep_distributed_config("dbo_all2all:model", world_size=2, experts="auto").ep_implementation \
        == "dbo_all2all"
    assert ep_distributed_config("dbo_all2all:model", world_size=2, experts="library").ep_implementation \
        == "dbo_all2all:library"
    with pytest.raises(ValueError, match="experts must be one of"):
        ep_distributed_config("all2all", world_size=2, experts="fast")
    with pytest.raises(ValueError, match="experts must be one of"):
        register_ep_implementation("dbo_x", "naive", experts="fast")
    experts = _experts_module("mixtral")
    with pytest.raises(ValueError, match="experts must be one of"):
        make_experts(experts, experts.forward, "fast")
    assert isinstance(make_experts(experts, experts.forward)[0], LibraryExperts)
    assert isinstance(make_experts(experts, experts.forward, "model")[0], ModelExperts)
    with pytest.raises(ValueError, match="reduce_in_experts"):
        LibraryExperts(experts, reduce_in_experts=False)
    plain = _tiny_model("qwen3_moe", 0)  # not loaded expert-parallel
    assert ep_experts(plain) == {}
    with pytest.raises(ValueError, match="no experts module running through dbo"):
        switch_ep_experts(plain, "model")
    with pytest.raises(ValueError, match="experts must be one of"):
        switch_ep_experts(plain, "fast")
