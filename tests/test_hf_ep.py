"""Checkpoints loaded expert-parallel by transformers (>= 5.23) with dbo's backends as its EP
implementations, on 2 gloo ranks.

Tiny random-weight Qwen3-MoE, Mixtral and DeepSeek-V3 checkpoints written with
``save_pretrained`` (which writes the Hub's per-expert keys: ``...experts.{i}.gate_proj.weight``,
Mixtral's ``block_sparse_moe.experts.{i}.w1.weight``), plus one in the fused in-memory layout,
loaded with ``DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="dbo_<backend>")``.
On each rank's own batch (different batch sizes, left padding), float32: the logits equal the
full unconverted model's, plain and overlapped (``DBOPrefill``), and transformers' own
``all_to_all`` EP gives the same on the same batch; greedy generation equals ``generate()``;
each rank holds half of the routed experts' bytes, and the dense weights, once whole, are not
all-gathered again.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
ep_module = pytest.importorskip("transformers.distributed.expert_parallel",
                                reason="transformers < 5.23 has no EP implementation interface")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240), pytest.mark.dist_world(pg_timeout_s=60.0)]

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
BACKENDS = ("naive", "all2all")
CLASSES = {"naive": "NaivePrepareAndFinalize", "all2all": "AllToAllPrepareAndFinalize",
           "copy_engine": "CopyEnginePrepareAndFinalize"}
TOL = 1e-5  # float32, relative to the largest logit of real tokens


def _tiny_model(family: str, seed: int):
    from dbo.integrations.transformers.presets import tiny_random_model

    return tiny_random_model(family, seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory written by save_pretrained; "qwen3_moe_fused" -> the same weights
    as Qwen3-MoE's with the in-memory fused expert keys (``mlp.experts.gate_up_proj``)."""
    import shutil

    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, family in enumerate(FAMILIES):
        model = _tiny_model(family, i)
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    fused = root / "qwen3_moe_fused"
    shutil.copytree(root / "qwen3_moe", fused)
    state = {k: v.contiguous() for k, v in _tiny_model("qwen3_moe", 0).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    out["qwen3_moe_fused"] = str(fused)
    return out


def _inputs(rank: int, seed: int):
    from dbo.testing.hf import left_padded_prompts

    return left_padded_prompts(seed * 101 + rank, ((0, 3, 0), (2, 0, 0, 6, 1))[rank], 7)  # padding per rank


def _load(path: str, implementation: str | None):
    from transformers.distributed import DistributedConfig

    from dbo.testing.hf import load_float32

    return load_float32(path, None if implementation is None else DistributedConfig(
        fsdp_size=2, ep_size=2, ep_implementation=implementation))


def _logits_job(path: str, backends: tuple[str, ...], seed: int) -> dict:
    import torch
    import torch.distributed as dist

    import dbo
    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.ep_model import expert_parallel_modules

    rank = dist.get_rank()
    ids, mask = _inputs(rank, seed)
    valid = mask.bool()
    full = _load(path, None)
    with torch.no_grad():
        want = prefill_logits(full, ids, mask, mask_padding_tokens=False)
        theirs = prefill_logits(_load(path, "all_to_all"), ids, mask, mask_padding_tokens=False)
    scale = want[valid].abs().max().item()

    def err(a, b=want):
        return (a - b)[valid].abs().max().item() / scale

    out = {"theirs_err": err(theirs)}
    for backend in backends:
        model = _load(path, f"dbo_{backend}")
        layers = expert_parallel_modules(model)
        trace = dbo.Trace()
        with torch.inference_mode():
            prefill = DBOPrefill(model, prefill_split_config(adaptive=False), trace=trace)
            overlapped = prefill(ids, mask)
            plain = prefill_logits(model, ids, mask)
        events = [(e.kind, e.ubatch, e.detail) for e in trace.events]
        out[backend] = {
            "plain_err": err(plain), "dbo_err": err(overlapped), "vs_theirs": err(overlapped, theirs),
            "split": prefill.last_plan.split, "interleaved": ("resume", 1, "") in events,
            "layers": len(layers), "backend": type(layers[0][1].kernel.prepare_finalize).__name__,
            "first_expert": layers[0][1].first_expert,
        }
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_logits_equal_full_model_and_transformers_ep(world2, checkpoints, family):
    results = world2.run(_logits_job, checkpoints[family], BACKENDS, 0, timeout_s=180)
    layers = 2  # MoE layers (DeepSeek-V3's tiny config has one dense layer before them)
    for rank, r in enumerate(results):
        assert r["theirs_err"] <= TOL, f"rank {rank}: transformers' EP != full ({r['theirs_err']:.1e})"
        for backend in BACKENDS:
            b = r[backend]
            assert b["plain_err"] <= TOL, f"rank {rank} {backend}: plain {b['plain_err']:.1e}"
            assert b["dbo_err"] <= TOL, f"rank {rank} {backend}: DBO {b['dbo_err']:.1e}"
            assert b["vs_theirs"] <= TOL, f"rank {rank} {backend}: vs all_to_all {b['vs_theirs']:.1e}"
            assert b["split"] and b["interleaved"], f"rank {rank} {backend}: the ubatches did not overlap"
            assert b["layers"] == layers and b["first_expert"] == 4 * rank
            assert b["backend"] == CLASSES[backend]


def test_fused_layout_checkpoint(world2, checkpoints):
    # the in-memory key layout loads expert-parallel too, with the same weights as the Hub layout
    fused = world2.run(_logits_job, checkpoints["qwen3_moe_fused"], ("all2all",), 0, timeout_s=120)
    for r in fused:
        assert r["theirs_err"] <= TOL and r["all2all"]["dbo_err"] <= TOL, r


def _generate_job(path: str, backend: str, new_tokens: int) -> dict:
    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.split import SplitConfig

    ids, mask = _inputs(dist.get_rank(), 5)
    full, model = _load(path, None), _load(path, f"dbo_{backend}")
    with torch.inference_mode():
        want = full.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        plain, _ = greedy_generate(model, ids, mask, max_new_tokens=new_tokens,
                                   config=SplitConfig(enabled=False))
        overlapped, plan = greedy_generate(model, ids, mask, max_new_tokens=new_tokens)
        every_step, _ = greedy_generate(model, ids, mask, max_new_tokens=new_tokens, split_decode=True)
    return {"plain_ok": torch.equal(plain, want), "dbo_ok": torch.equal(overlapped, want),
            "every_step_ok": torch.equal(every_step, want), "split": plan.split}


@pytest.mark.parametrize("family, backend", [("qwen3_moe", "all2all"), ("mixtral", "naive"),
                                             ("deepseek_v3", "copy_engine")])
def test_greedy_generation_equals_generate(world2, checkpoints, family, backend):
    for rank, r in enumerate(world2.run(_generate_job, checkpoints[family], backend, 4, timeout_s=180)):
        assert r["split"], f"rank {rank}"
        assert r["plain_ok"], f"rank {rank}: greedy tokens (no DBO) != generate()"
        assert r["dbo_ok"], f"rank {rank}: DBO greedy tokens != generate()"
        assert r["every_step_ok"], f"rank {rank}: DBO greedy tokens (every step split) != generate()"


def _autotune_job(path: str, margin: float) -> dict:
    import torch

    from dbo.integrations.transformers import DBOPrefill, prefill_logits

    model = _load(path, "dbo_all2all")
    ids = torch.randint(0, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        prefill = DBOPrefill(model)
        result = prefill.autotune(6, [2, 4], steps=1, warmup=0, margin=margin)
        got, want = prefill(ids), prefill_logits(model, ids)
    return {"threshold": result.threshold, "config": prefill.wrapper.config.prefill_token_threshold,
            "rows": [r.tokens for r in result.rows], "split": prefill.last_plan.split,
            "equal": torch.allclose(got, want, rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("margin", [0.0, 0.99])
def test_prefill_autotune_keeps_its_choice(world2, checkpoints, margin):
    # margin 0.99: DBO would have to be 100x faster, so the prefill falls back to plain
    for r in world2.run(_autotune_job, checkpoints["qwen3_moe"], margin, timeout_s=180):
        assert r["rows"] == [2, 4] and r["config"] == r["threshold"], r
        assert r["split"] == (r["threshold"] <= 4), r
        if margin > 0.5:
            assert not r["split"], r
        assert r["equal"], r


class _Recorder:
    """A kernel that records the tokens of each call and runs the kernel it wraps."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, x, *args, **kwargs):
        self.calls.append(x.shape[0])
        return self.kernel(x, *args, **kwargs)


def _decode_backend_job(path: str, new_tokens: int) -> dict:
    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers import use_backend
    from dbo.integrations.transformers.ep_model import expert_parallel_modules
    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.split import SplitConfig

    ids, mask = _inputs(dist.get_rank(), 5)
    full, model = _load(path, None), _load(path, "dbo_all2all")
    use_backend(model, "all2all", decode_backend="copy_engine")
    out = {}
    with torch.inference_mode():
        want = full.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        greedy_generate(model, ids, mask, max_new_tokens=2, config=SplitConfig(enabled=False))  # builds both
        prefill_calls, decode_calls = [], []
        for _, impl in expert_parallel_modules(model):
            out["kinds"] = (type(impl.kernel.prepare_finalize).__name__,
                            type(impl.decode_kernel.prepare_finalize).__name__)
            impl.kernel = _Recorder(impl.kernel, prefill_calls)
            impl.decode_kernel = _Recorder(impl.decode_kernel, decode_calls)
        for name, cfg, every in (("plain", SplitConfig(enabled=False), False), ("dbo", None, True),
                                 ("dbo-prefill", None, False)):
            prefill_calls.clear()
            decode_calls.clear()
            got, plan = greedy_generate(model, ids, mask, max_new_tokens=new_tokens, config=cfg,
                                        split_decode=every)
            out[name] = {"ok": torch.equal(got, want), "split": plan.split,
                         "prefill": sorted(set(prefill_calls)), "decode": sorted(set(decode_calls)),
                         "calls": (len(prefill_calls), len(decode_calls))}
    out["rows"] = ids.shape[0]
    return out


def test_generation_moves_decode_steps_through_the_decode_backend(world2, checkpoints):
    new_tokens, layers = 4, 2
    for rank, r in enumerate(world2.run(_decode_backend_job, checkpoints["qwen3_moe"], new_tokens,
                                       timeout_s=180)):
        assert r["kinds"] == ("AllToAllPrepareAndFinalize", "CopyEnginePrepareAndFinalize"), r
        rows = r["rows"]
        for name, prefill_ubatches, decode_ubatches in (("plain", 1, 1), ("dbo", 2, 2),
                                                         ("dbo-prefill", 2, 1)):
            g = r[name]
            assert g["ok"], f"rank {rank} {name}: tokens != generate() with a decode backend"
            assert g["split"] == (prefill_ubatches == 2), f"rank {rank} {name}"
            # the prompt through the prefill backend, one token per sequence through the other
            assert g["calls"] == (layers * prefill_ubatches, layers * decode_ubatches * (new_tokens - 1)), \
                (rank, name, g)
            assert max(g["prefill"]) > rows and max(g["decode"]) <= rows, (rank, name, g)
            if decode_ubatches == 1:  # the joined cache: every sequence in each decode call
                assert g["decode"] == [rows], (rank, name, g)


def _use_backend_job(path: str) -> dict:
    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config, use_backend
    from dbo.integrations.transformers.ep_model import expert_parallel_modules

    ids, mask = _inputs(dist.get_rank(), 6)
    model = _load(path, "dbo_naive")
    out = {"refused": ""}
    try:
        use_backend(model, "copy_engine", group=object())
    except ValueError as exc:  # a loaded model keeps the group it was loaded on
        out["refused"] = str(exc)
    use_backend(model, "copy_engine")
    with torch.inference_mode():
        plain = prefill_logits(model, ids, mask)
        prefill = DBOPrefill(model, prefill_split_config(adaptive=False))
        overlapped = prefill(ids, mask)
    valid = mask.bool()
    out["err"] = ((overlapped - plain)[valid].abs().max() / plain[valid].abs().max()).item()
    out["split"] = prefill.last_plan.split
    out["kinds"] = sorted({type(impl.kernel.prepare_finalize).__name__
                           for _, impl in expert_parallel_modules(model)})
    return out


def test_use_backend_switches_a_loaded_model(world2, checkpoints):
    # loaded with dbo_naive, switched with use_backend (the benchmarks' route): every experts
    # module on copy_engine from its next call, DBO's logits equal the plain forward's
    for r in world2.run(_use_backend_job, checkpoints["mixtral"], timeout_s=120):
        assert r["kinds"] == ["CopyEnginePrepareAndFinalize"], r
        assert r["split"] and r["err"] <= 1e-5, r
        assert r["refused"].startswith("group: a model loaded with ep_distributed_config"), r


def _memory_job(path: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dbo.integrations.transformers import prefill_logits
    from dbo.integrations.transformers.ep import prepare_for_overlap
    from dbo.integrations.transformers.fsdp import count_all_gathered_bytes

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    def expert_bytes(model):
        return sum(local(p).untyped_storage().nbytes() for n, p in model.named_parameters()
                   if ".experts." in n and "shared" not in n)

    full = _load(path, None)
    model = _load(path, "dbo_all2all")
    ids, mask = _inputs(dist.get_rank(), 7)
    gathered = []
    with count_all_gathered_bytes() as gathers, torch.no_grad():
        for _ in range(2):  # the first forward keeps the dense weights whole: nothing gathered after it
            gathers.clear()
            prefill_logits(model, ids, mask)
            gathered.append(sum(gathers))
        gathers.clear()
        prepare_for_overlap(model)  # already done at the first forward: a no-op
        gathered.append(sum(gathers))
    dense = {n: p for n, p in model.named_parameters() if ".experts." not in n}
    full_dense = dict(full.named_parameters())
    return {
        "experts_bytes": expert_bytes(model), "full_experts_bytes": expert_bytes(full),
        "experts_after_forward": expert_bytes(model),
        "dense_whole": all(not isinstance(p, DTensor) and p.shape == full_dense[n].shape
                           for n, p in dense.items()),
        "dense_bytes": sum(p.numel() * p.element_size() for p in dense.values()),
        "gathered": gathered,
    }


def test_each_rank_holds_half_the_experts_and_gathers_dense_weights_once(world2, checkpoints):
    for rank, r in enumerate(world2.run(_memory_job, checkpoints["qwen3_moe"], timeout_s=120)):
        assert r["experts_bytes"] * 2 == r["full_experts_bytes"], f"rank {rank}: {r}"
        assert r["experts_after_forward"] == r["experts_bytes"], f"rank {rank}: {r}"
        assert r["dense_whole"], f"rank {rank}: a dense weight is still sharded after the first forward"
        first, second, prepare = r["gathered"]
        assert first >= r["dense_bytes"] and second == prepare == 0, f"rank {rank}: {r}"


# ---- single process ------------------------------------------------------------------------


def test_dbo_names_are_registered():
    from dbo.integrations import transformers as _  # noqa: F401  (registers them)
    from dbo.integrations.transformers.ep import EP_IMPLEMENTATIONS, DBOExpertParallel

    names = ep_module.EPImplementationInterface()
    for name, (backend, _kw) in EP_IMPLEMENTATIONS.items():
        assert issubclass(names[name], DBOExpertParallel) and names[name].backend == backend
    assert names["dbo_deepep_ll"].backend_kwargs == {"max_tokens_per_rank": 256}
    assert (names["dbo_deepep"].backend, names["dbo_deepep"].decode_backend) == ("deepep_ht", "deepep_ll")
    assert names["dbo_deepep"].decode_backend_kwargs == {"max_tokens_per_rank": 256}
    assert names["dbo_deepep_ht"].decode_backend is None


def test_older_transformers_gets_the_version_it_needs(monkeypatch):
    import sys

    from dbo.integrations.transformers.ep import (
        TransformersVersionError,
        ep_distributed_config,
        register_default_ep_implementations,
    )

    monkeypatch.setitem(sys.modules, "transformers.distributed.expert_parallel", None)
    with pytest.raises(TransformersVersionError, match=r"transformers >= 5\.23.*installed"):
        ep_distributed_config("all2all", world_size=2)
    assert register_default_ep_implementations() == []  # conversion still imports and works


def test_config_and_mistakes():
    from dbo.integrations.transformers.ep import (
        DBOExpertParallel,
        UnsupportedEPError,
        ep_distributed_config,
        register_ep_implementation,
    )

    cfg = ep_distributed_config("deepep_ht", world_size=4)
    assert (cfg.fsdp_size, cfg.ep_size, cfg.ep_implementation) == (4, 4, "dbo_deepep_ht")
    with pytest.raises(ValueError, match="unknown backend"):
        ep_distributed_config("nope", world_size=2)
    assert ep_distributed_config("deepep", world_size=2).ep_implementation == "dbo_deepep"
    with pytest.raises(ValueError, match=r"one rank: transformers loads a model whole.*convert_to_exp"):
        ep_distributed_config("all2all", world_size=1)
    with pytest.raises(ValueError, match="unknown decode_backend"):
        register_ep_implementation("dbo_test_bad", "all2all", decode_backend="nope")
    with pytest.raises(ValueError, match="without decode_backend"):
        register_ep_implementation("dbo_test_bad", "all2all", decode_backend_kwargs={"a": 1})

    class Mesh:
        def size(self):
            return 2

    with pytest.raises(UnsupportedEPError, match="tp_size=1"):
        DBOExpertParallel(object(), Mesh(), Mesh())


def test_a_deployment_file_rides_on_the_implementation(tmp_path):
    from dbo.deployment import DeploymentConfig, save_deployment_config
    from dbo.integrations.transformers.ep import ep_distributed_config, ep_interface
    from dbo.split import SplitConfig

    tuned = DeploymentConfig(SplitConfig(decode_token_threshold=96), sbo_groups=4, sm_carveout=8,
                             deployment={"group_size": 64})
    path = tmp_path / "dbo_ep64.json"
    save_deployment_config(path, tuned)
    name = ep_distributed_config("deepep", world_size=2, deployment=path).ep_implementation
    assert name.startswith("dbo_deepep@")
    cls = ep_interface()()[name]
    assert cls.deployment == tuned and cls.deployment.sbo_groups == 4
    assert (cls.backend, cls.decode_backend) == ("deepep_ht", "deepep_ll")
    assert cls.decode_backend_kwargs == ep_interface()()["dbo_deepep"].decode_backend_kwargs
    assert ep_interface()()["dbo_deepep"].deployment is None  # the plain name is untouched
    # the same config (a value or its file) is one name; another config another
    assert ep_distributed_config("deepep", world_size=2, deployment=tuned).ep_implementation == name
    other = DeploymentConfig(SplitConfig(decode_token_threshold=32))
    assert ep_distributed_config("deepep", world_size=2, deployment=other).ep_implementation != name
    assert ep_distributed_config("all2all", world_size=2, experts="model", deployment=tuned
                                 ).ep_implementation.startswith("dbo_all2all:model@")
    with pytest.raises(FileNotFoundError):
        ep_distributed_config("deepep", world_size=2, deployment=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a dbo deployment config"):
        ep_distributed_config("deepep", world_size=2, deployment=tmp_path / "bad.json")


def _slot_sum(experts, x, ids, weights):
    # the reference: each local slot through the module alone (no sentinel ids), weighted, summed
    import torch

    ones = torch.ones(x.shape[0], 1)
    return sum(torch.where((ids[:, k] >= 0).unsqueeze(1), weights[:, k:k + 1] * experts(
        x, ids[:, k:k + 1].clamp(min=0), ones), 0.0) for k in range(ids.shape[1]))


def test_model_experts_masks_the_sentinel_rows_of_grouped_mm(monkeypatch):
    # transformers' grouped_mm experts leave the rows of sentinel ids ("no local expert")
    # unwritten and mask them only in expert-parallel mode; ModelExperts passes sentinels, so it
    # turns that mode on. Unwritten rows made NaN here (as uninitialized memory can be): a token
    # with no local slot still gets zeros, the others their slots' sum
    import torch
    import transformers.integrations.moe as hf_moe

    from dbo.integrations.transformers.ep import ModelExperts
    from dbo.moe import ActivationFormat, Workspace

    grouped_linear = hf_moe._grouped_linear

    def unwritten_tail_is_nan(input, weight, offs, *args, **kwargs):
        out = grouped_linear(input, weight, offs, *args, **kwargs)
        out[int(offs[-1]):] = float("nan")
        return out

    monkeypatch.setattr(hf_moe, "_grouped_linear", unwritten_tail_is_nan)
    block = _tiny_model("qwen3_moe", 4).model.layers[0].mlp
    assert block.experts.config._experts_implementation == "grouped_mm"
    assert not block.experts._is_expert_parallel
    experts = ModelExperts(block.experts, block.experts.forward)
    assert block.experts._is_expert_parallel
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g)
    ids = torch.tensor([[-1, -1], [2, -1], [4, 1], [-1, 7], [0, 0]])
    weights = torch.rand(5, 2, generator=g)
    got = experts.apply(x, None, None, weights, ids, activation_format=ActivationFormat.STANDARD,
                        expert_tokens_meta=None, apply_router_weight_on_input=False, workspace=Workspace())
    want = _slot_sum(block.experts, x, ids, weights)
    assert torch.equal(got[0], torch.zeros(32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_model_experts_batched_format_equals_standard():
    # deepep_ll hands the experts [experts, rows, hidden] slabs: the same rows as STANDARD
    import torch

    from dbo.integrations.transformers.ep import ModelExperts
    from dbo.moe import ActivationFormat, ExpertTokensMetadata, Workspace

    block = _tiny_model("qwen3_moe", 3).model.layers[0].mlp
    experts = ModelExperts(block.experts, block.experts.forward)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g)
    ids = torch.tensor([[0, 3], [1, -1], [3, 7], [-1, -1], [5, 0], [2, 6]])
    weights = torch.rand(6, 2, generator=g)
    kw = dict(expert_tokens_meta=None, apply_router_weight_on_input=False, workspace=Workspace())
    std = experts.apply(x, None, None, weights, ids, activation_format=ActivationFormat.STANDARD, **kw)
    ref = _slot_sum(block.experts, x, ids, weights)
    torch.testing.assert_close(std, ref, rtol=1e-5, atol=1e-6)
    # batched: expert e's slab holds the tokens routed to it (unweighted)
    slabs = torch.zeros(8, 4, 32)
    counts = torch.zeros(8, dtype=torch.int32)
    for t, k in ((ids >= 0).nonzero().tolist()):
        e = int(ids[t, k])
        slabs[e, counts[e]] = x[t]
        counts[e] += 1
    kw["expert_tokens_meta"] = ExpertTokensMetadata(counts)
    out = experts.apply(slabs, None, None, None, None, activation_format=ActivationFormat.BATCHED_EXPERTS,
                        **kw)
    for e in range(8):
        n = int(counts[e])
        one = torch.full((n, 1), e)
        torch.testing.assert_close(out[e, :n], block.experts(slabs[e, :n], one, torch.ones(n, 1)))
