"""transformers MoE models (Qwen3-MoE, Mixtral, DeepSeek-V3) made expert-parallel with
dbo.integrations.transformers, on 2 gloo ranks: the converted model's logits equal the original
model's, with DBO on (DBOPrefill, split at sequence boundaries) and off, for each CPU backend;
odd batch sizes, left padding, a rank whose sequences are all padding, a rank whose second
ubatch is all padding, random batch shapes (hypothesis), and greedy generation with a KV cache
per ubatch against the original model's generate(). Tiny random-weight configs built
from each family's config class: no downloads."""

from __future__ import annotations

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240), pytest.mark.dist_world(pg_timeout_s=60.0)]

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
BACKENDS = ("naive", "all2all", "copy_engine")


TOL = 1e-4  # float32 end to end, relative to the largest logit


def _inputs(rank: int, batches: list[int], seq: int, pads: list[list[int]], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed * 101 + rank)
    b = batches[rank]
    ids = torch.randint(0, 64, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    for i, p in enumerate(pads[rank][:b]):
        mask[i, :min(p, seq)] = 0  # left padding (p >= seq: an all-padding sequence)
    return ids, mask


def _hf_job(family: str, backend: str, batches: list[int], seq: int, pads: list[list[int]],
            min_sequences: int, seed: int, plan_slices: list | None = None,
            expert_schedule: str = "split", switch_to: str | None = None) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import dbo
    from dbo.integrations.transformers import (
        DBOPrefill,
        convert_to_expert_parallel,
        prefill_logits,
        prefill_split_config,
        use_backend,
    )
    from dbo.integrations.transformers.moe_block import ExpertParallelMoE
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config
    from dbo.split import SplitReason, UBatchPlan

    rank = dist.get_rank()
    torch.manual_seed(seed)  # same weights on every rank
    model = causal_lm_class(family)(tiny_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # large enough that routing differs token to token
    original = copy.deepcopy(model)
    convert_to_expert_parallel(model, None, backend=backend)
    if switch_to is not None:  # the benchmarks' route: one call, whichever way the model was made
        use_backend(model, switch_to)
        use_backend(model, switch_to, decode_backend="naive")  # for the calls inside decode_phase
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    ids, mask = _inputs(rank, batches, seq, pads, seed)
    routed = []  # per MoE call of the first converted block: tokens routed to any expert
    pf = blocks[0].kernel.prepare_finalize
    prepare_async = pf.prepare_async

    def spy(a1, topk_weights, topk_ids, *args, **kwargs):
        routed.append(int((topk_ids >= 0).any(dim=1).sum()))
        return prepare_async(a1, topk_weights, topk_ids, *args, **kwargs)

    pf.prepare_async = spy
    trace = dbo.Trace()
    config = prefill_split_config(min_sequences, expert_schedule=expert_schedule, adaptive=False)
    runner = DBOPrefill(model, config, trace=trace)
    with torch.inference_mode():
        want = prefill_logits(original, ids, mask, mask_padding_tokens=False)
        plain = prefill_logits(model, ids, mask)
        plan = None
        if plan_slices is not None:  # a given split, whatever the planner's policy
            slices = tuple(tuple(sl) for sl in plan_slices[rank])
            padded = max(b - a for sl in plan_slices for a, b in sl)
            plan = UBatchPlan(batches[rank], slices, padded, SplitReason.SPLIT)
        overlapped = runner(ids, mask, plan=plan)
    valid = mask.bool()
    scale = want[valid].abs().max().item() if valid.any() else 1.0

    def err(a):
        return (a - want)[valid].abs().max().item() / scale if valid.any() else 0.0

    events = [(e.kind, e.ubatch, e.detail) for e in trace.events]
    return {
        "plain_err": err(plain), "dbo_err": err(overlapped),
        "shape_ok": overlapped.shape == want.shape == plain.shape,
        "split": runner.last_plan.split, "reason": runner.last_plan.reason.value,
        "padded": runner.last_plan.padded_size,
        "local_experts": [b.expert_range for b in blocks],
        # the other ranks' experts are gone: no module keeps the fused [E, ...] weights
        "freed": not any(hasattr(m, "gate_up_proj") for m in model.modules())
        and all(b.w1.shape[0] == b.num_experts // 2 for b in blocks),
        "interleaved": ("resume", 1, "") in events,
        # padding tokens and ubatch padding rows route to no expert: plain + DBO run
        "routed_ok": sum(routed) == 2 * int(mask.sum()),
        "schedule": runner.last_plan.expert_schedule.value,
        "regions": [d for k, _, d in events if k == "region_begin"],
        "moe_layers": len(blocks),
        "backends": sorted({type(b.kernel.prepare_finalize).__name__ for b in blocks}),
        "decode_backends": sorted({type(b.decode_kernel.prepare_finalize).__name__ for b in blocks
                                   if b.decode_kernel is not None}),
    }


def _check(results: list[dict], *, split: bool | None = True) -> None:
    for rank, r in enumerate(results):
        assert r["shape_ok"], f"rank {rank}"
        assert r["plain_err"] <= TOL, f"rank {rank}: converted != original ({r['plain_err']:.2e})"
        assert r["dbo_err"] <= TOL, f"rank {rank}: DBO != original ({r['dbo_err']:.2e})"
        assert r["routed_ok"], f"rank {rank}: a padding token was routed to an expert"
        assert split is None or r["split"] is split, f"rank {rank}: {r['reason']}"
        if r["split"]:
            assert r["interleaved"], f"rank {rank}: the ubatches did not interleave"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_equals_original(world2, family, backend):
    # odd batch sizes, different on each rank, some left-padded sequences
    results = world2.run(_hf_job, family, backend, [3, 5], 7, [[0, 3, 0], [2, 0, 0, 6, 1]], 2, 0,
                        timeout_s=120)
    _check(results)
    assert results[0]["padded"] == results[1]["padded"] == 3
    # each rank holds its own half of the experts of every MoE layer
    assert {r["local_experts"][0] for r in results} == {(0, 4), (4, 8)}
    assert all(r["freed"] for r in results)


@pytest.mark.parametrize("backend", ("naive", "all2all"))
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_expert_schedule(world2, family, backend):
    # the merged schedule through SplitConfig: one experts call per MoE layer over both
    # ubatches' rows, the same logits as the original model
    results = world2.run(_hf_job, family, backend, [3, 5], 7, [[0, 3, 0], [2, 0, 0, 6, 1]], 2, 0,
                        None, "merged", timeout_s=120)
    _check(results)
    for r in results:
        assert r["schedule"] == "merged"
        assert r["regions"].count("experts_merged") == r["moe_layers"] > 0
        assert "experts" not in r["regions"]


@pytest.mark.parametrize("switch_to, cls", [("all2all", "AllToAllPrepareAndFinalize"),
                                             ("copy_engine", "CopyEnginePrepareAndFinalize")])
def test_use_backend_switches_a_converted_model(world2, switch_to, cls):
    # converted with naive, switched with use_backend: every block on the new backend, the
    # same logits as the original model plain and overlapped (outside decode_phase: the decode
    # backend, naive, is kept for the calls inside it)
    results = world2.run(_hf_job, "mixtral", "naive", [3, 5], 7, [[0, 3, 0], [2, 0, 0, 6, 1]], 2, 0,
                        None, "split", switch_to, timeout_s=120)
    _check(results)
    for r in results:
        assert r["backends"] == [cls], r
        assert r["decode_backends"] == ["NaivePrepareAndFinalize"], r


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_with_only_padding_sequences(world2, family):
    # rank 1 has nothing to do: it still runs (the MoE layers are collective) on padding sequences
    results = world2.run(_hf_job, family, "all2all", [4, 2], 6, [[1, 0, 0, 2], [6, 6]], 2, 1,
                        timeout_s=120)
    _check(results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ubatch_of_padding_rows(world2, backend):
    # rank 0 has one sequence: its second ubatch is all padding rows (padded to rank 1's 2)
    slices = [[(0, 1), (1, 1)], [(0, 2), (2, 4)]]
    results = world2.run(_hf_job, "deepseek_v3", backend, [1, 4], 5, [[0], [0, 2, 0, 0]], 1, 2,
                        slices, timeout_s=120)
    _check(results)
    assert [r["padded"] for r in results] == [2, 2]


def test_below_threshold_runs_plain_everywhere(world2):
    results = world2.run(_hf_job, "qwen3_moe", "all2all", [1, 4], 5, [[0], [0] * 4], 2, 3,
                        timeout_s=120)
    _check(results, split=False)
    assert [r["reason"] for r in results] == ["below_threshold", "disagreement"]


# each example is a 2-rank job (~0.3 s): a tenth of the profile's examples (ci: 6)
@settings(max_examples=max(3, settings().max_examples // 10))
@given(data=st.data())
def test_random_batch_shapes(world2, data):
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    backend = data.draw(st.sampled_from(BACKENDS), label="backend")
    seq = data.draw(st.integers(1, 9), label="seq")
    batches = data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=2), label="batches")
    pads = [data.draw(st.lists(st.integers(0, seq), min_size=b, max_size=b), label=f"pads{r}")
            for r, b in enumerate(batches)]
    min_sequences = data.draw(st.integers(1, 3), label="min_sequences")
    note(f"{family} {backend} batches={batches} seq={seq} pads={pads} min_seq={min_sequences}")
    results = world2.run(_hf_job, family, backend, batches, seq, pads, min_sequences, 4, timeout_s=120)
    # whether it splits is the planner's policy; whatever it chose must give the same logits
    _check(results, split=None if min(batches) >= min_sequences else False)


def _generate_job(family: str, backend: str, batches: list[int], pads: list[list[int]],
                  new_tokens: int, seed: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers import convert_to_expert_parallel
    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config
    from dbo.split import SplitConfig

    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = causal_lm_class(family)(tiny_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    original = copy.deepcopy(model)
    convert_to_expert_parallel(model, None, backend=backend)
    ids, mask = _inputs(rank, batches, 6, pads, seed)
    with torch.inference_mode():
        want = original.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        plain, _ = greedy_generate(model, ids, mask, max_new_tokens=new_tokens,
                                   config=SplitConfig(enabled=False))
        overlapped, plan = greedy_generate(model, ids, mask, max_new_tokens=new_tokens)
        every_step, _ = greedy_generate(model, ids, mask, max_new_tokens=new_tokens, split_decode=True)
    real = mask.any(dim=1)  # an all-padding prompt generates noise
    return {"plain_ok": torch.equal(plain[real], want[real]),
            "dbo_ok": torch.equal(overlapped[real], want[real]),
            "every_step_ok": torch.equal(every_step[real], want[real]),
            "split": plan.split, "reason": plan.reason.value}


@pytest.mark.parametrize("family, backend", [("qwen3_moe", "all2all"), ("mixtral", "naive"),
                                             ("deepseek_v3", "all2all")])
def test_greedy_generation_with_kv_cache(world2, family, backend):
    # the prefill split; the decode steps plain over the joined caches (the default), or split
    # as the prefill with one KV cache per ubatch (split_decode=True); ranks of 3 and 5
    # sequences, so rank 0's ubatches carry padding rows that the join drops
    results = world2.run(_generate_job, family, backend, [3, 5], [[0, 4, 0], [2, 0, 0, 5, 0]], 4, 5,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert r["split"], f"rank {rank}: {r['reason']}"
        assert r["plain_ok"], f"rank {rank}: converted model's greedy tokens != original generate()"
        assert r["dbo_ok"], f"rank {rank}: DBO greedy tokens != original generate()"
        assert r["every_step_ok"], f"rank {rank}: DBO greedy tokens (every step split) != generate()"


# ---- single process: what is refused ------------------------------------------------------


def test_unsupported_moe_block_is_named():
    import torch

    from dbo.integrations.transformers import UnsupportedModelError, convert_to_expert_parallel

    cfg = transformers.Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                      moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match="Qwen2MoeSparseMoeBlock.*Qwen3MoeSparseMoeBlock"):
        convert_to_expert_parallel(model, None, backend="naive")


def test_dense_model_is_refused():
    import torch

    from dbo.integrations.transformers import UnsupportedModelError, convert_to_expert_parallel

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match="no sparse MoE block.*MixtralSparseMoeBlock"):
        convert_to_expert_parallel(model, None)


def test_backend_registry_checks():
    import torch

    from dbo.backends import BACKENDS, cpu_backends, make_backend

    assert cpu_backends() == ["all2all", "copy_engine", "naive"]
    assert {"deepep_ht", "deepep_ll"} <= set(BACKENDS)
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("nope", None, hidden=8, num_experts=4, topk=2, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="bf16"):
        make_backend("deepep_ht", None, hidden=8, num_experts=4, topk=2, dtype=torch.float32,
                     device="cpu")


def test_use_backend_refuses_a_bad_name_first_and_a_model_that_is_not_expert_parallel():
    import torch

    from dbo.backends import BACKENDS, describe_backend
    from dbo.integrations.transformers import use_backend
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    with torch.device("meta"):
        model = causal_lm_class("qwen3_moe")(tiny_config("qwen3_moe"))
    with pytest.raises(ValueError) as bad:
        use_backend(model, "nope")
    listed = ", ".join(map(describe_backend, sorted(BACKENDS)))
    assert str(bad.value) == f"unknown backend 'nope'; choose from {listed}"
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM is not expert-parallel with dbo"):
        use_backend(model, "naive")


def test_caller_mistakes_are_refused():
    import torch

    from dbo.integrations.transformers import DBOPrefill, set_backend
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    with torch.device("meta"):
        model = causal_lm_class("mixtral")(tiny_config("mixtral"))
    with pytest.raises(ValueError, match="no converted MoE block"):
        set_backend(model, "naive")
    prefill = DBOPrefill(model)
    with pytest.raises(ValueError, match="all-padding sequence"):
        prefill(torch.zeros(0, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        prefill(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="must match"):
        prefill(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))


def test_join_caches_keeps_real_rows_in_order_and_refuses_what_it_cannot_join():
    import torch
    from transformers.cache_utils import DynamicCache

    from dbo.integrations.transformers.generate import join_caches

    def cache(rows, seq, fill):
        c = DynamicCache()
        for layer in range(2):
            k = torch.full((rows, 2, seq, 4), float(fill + layer))
            c.update(k, -k, layer)
        return c

    # ubatch 0: 2 real rows of 3; ubatch 1: 1 real row of 3
    joined = join_caches([cache(3, 5, 10), cache(3, 5, 20)], [2, 1])
    assert joined is not None and len(joined.layers) == 2
    for layer in range(2):
        keys = joined.layers[layer].keys
        assert keys.shape == (3, 2, 5, 4)
        assert keys[:2].eq(10 + layer).all() and keys[2].eq(20 + layer).all()
        assert torch.equal(joined.layers[layer].values, -keys)
    assert joined.get_seq_length() == 5
    # other sequence lengths, another cache class, a missing layer: not joined
    assert join_caches([cache(3, 5, 0), cache(3, 6, 0)], [3, 3]) is None
    assert join_caches([cache(3, 5, 0), object()], [3, 3]) is None
    short = cache(3, 5, 0)
    short.layers.pop()
    assert join_caches([cache(3, 5, 0), short], [3, 3]) is None
