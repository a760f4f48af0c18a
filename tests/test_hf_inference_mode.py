"""A model loaded expert-parallel with dbo's implementations runs under ``torch.inference_mode()``
as ``from_pretrained`` returns it, on 2 gloo ranks.

transformers wraps the model in FSDP2, whose buffers made under inference mode break the
experts units at once and the dense units at the next forward outside it; dbo prepares the model
at its first forward (``dbo.integrations.transformers.fsdp``). A tiny Qwen3-MoE checkpoint; each rank its
own batch with left padding; float32. For each CPU implementation (``dbo_naive``,
``dbo_all2all``, ``dbo_copy_engine``) on a freshly loaded model: the first forward under
inference mode gives the unsharded model's logits, and the same model's later forwards under
``no_grad`` and inference mode give the same; ``generate()``, ``greedy_generate`` and
``DBOPrefill``, each the first call on a fresh model under inference mode, give what the plain
model gives, overlapped where they split.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240), pytest.mark.dist_world(pg_timeout_s=60.0)]

BACKENDS = ("naive", "all2all", "copy_engine")
TOL = 1e-5   # float32, against the unsharded model, relative to the largest logit of real tokens
SAME = 1e-6  # the same loaded model, another autograd mode or another call


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen3_checkpoint):
    return tiny_qwen3_checkpoint


def _inputs(rank: int):
    from dbo.testing.hf import left_padded_prompts

    return left_padded_prompts(11 + rank, ((2, 0, 0), (0, 4, 1, 0))[rank], 6)


def _load(path: str, backend: str | None):
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.testing.hf import load_float32

    return load_float32(path, None if backend is None else ep_distributed_config(backend))


def _rel(a, b, valid) -> float:
    return ((a - b)[valid].abs().max() / b[valid].abs().max()).item()


def _first_forward_job(path: str, backends: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dbo.integrations.transformers.fsdp import pending_first_forward

    ids, mask = _inputs(dist.get_rank())
    valid = mask.bool()
    with torch.no_grad():
        want = _load(path, None)(input_ids=ids, attention_mask=mask).logits
    out = {}
    for backend in backends:
        model = _load(path, backend)
        pending = pending_first_forward()
        with torch.inference_mode():  # the model's first call
            first = model(input_ids=ids, attention_mask=mask).logits
        with torch.no_grad():
            again = model(input_ids=ids, attention_mask=mask).logits
        with torch.inference_mode():
            third = model(input_ids=ids, attention_mask=mask).logits
        out[backend] = {
            "err": _rel(first, want, valid), "no_grad_after": _rel(again, first, valid),
            "inference_after": _rel(third, first, valid), "pending_after_load": pending,
            "pending_after_forward": pending_first_forward(),
            "dense_whole": _dense_whole(model),
            "experts_sharded": all(isinstance(p, DTensor) for n, p in model.named_parameters()
                                   if ".experts." in n),
        }
    return out


def test_first_forward_under_inference_mode(world2, checkpoint):
    for rank, r in enumerate(world2.run(_first_forward_job, checkpoint, BACKENDS, timeout_s=180)):
        for backend, b in r.items():
            where = f"rank {rank} dbo_{backend}: {b}"
            assert b["pending_after_load"] and not b["pending_after_forward"], where
            assert b["err"] <= TOL, where
            assert b["no_grad_after"] <= SAME and b["inference_after"] <= SAME, where
            assert b["dense_whole"] and b["experts_sharded"], where


def _dense_whole(model) -> bool:
    from torch.distributed.tensor import DTensor

    return all(not isinstance(p, DTensor) for n, p in model.named_parameters() if ".experts." not in n)


def _calls_job(path: str, backend: str, new_tokens: int) -> dict:
    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.split import SplitConfig

    ids, mask = _inputs(dist.get_rank())
    valid = mask.bool()
    gen = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    full = _load(path, None)
    with torch.no_grad():
        want_logits = prefill_logits(full, ids, mask, mask_padding_tokens=False)
        want_tokens = full.generate(ids, attention_mask=mask, **gen)
    out = {}
    model = _load(path, backend)
    with torch.inference_mode():  # generate() is the model's first call
        out["generate_ok"] = torch.equal(model.generate(ids, attention_mask=mask, **gen), want_tokens)
        plain, _ = greedy_generate(model, ids, mask, max_new_tokens=new_tokens,
                                   config=SplitConfig(enabled=False))
        overlapped, plan = greedy_generate(model, ids, mask, max_new_tokens=new_tokens)
    out["greedy_after_generate"] = (torch.equal(plain, want_tokens), torch.equal(overlapped, want_tokens),
                                    plan.split)
    model = _load(path, backend)
    with torch.inference_mode():  # greedy_generate with DBO is the model's first call
        overlapped, plan = greedy_generate(model, ids, mask, max_new_tokens=new_tokens)
        plain = model.generate(ids, attention_mask=mask, **gen)
    out["greedy_first"] = (torch.equal(overlapped, want_tokens), torch.equal(plain, want_tokens), plan.split)
    model = _load(path, backend)
    with torch.inference_mode():  # DBOPrefill is the model's first call
        prefill = DBOPrefill(model, prefill_split_config(adaptive=False))
        overlapped = prefill(ids, mask)
        # the two ubatches inside a layer left its dense weights whole (FSDP did not reshard them)
        out["dense_whole_after_dbo"] = _dense_whole(model)
        plain = prefill_logits(model, ids, mask)
    with torch.no_grad():
        plain_no_grad = prefill_logits(model, ids, mask)
    out["prefill_first"] = {"dbo_err": _rel(overlapped, want_logits, valid),
                            "plain_err": _rel(plain, want_logits, valid),
                            "dbo_vs_plain": _rel(overlapped, plain, valid),
                            "no_grad_vs_plain": _rel(plain_no_grad, plain, valid),
                            "split": prefill.last_plan.split}
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_greedy_and_prefill_first_under_inference_mode(world2, checkpoint, backend):
    for rank, r in enumerate(world2.run(_calls_job, checkpoint, backend, 3, timeout_s=180)):
        where = f"rank {rank} dbo_{backend}: {r}"
        assert r["generate_ok"], where
        assert r["greedy_after_generate"] == (True, True, True), where
        assert r["greedy_first"] == (True, True, True), where
        assert r["dense_whole_after_dbo"], where
        p = r["prefill_first"]
        assert p["split"], where
        assert p["dbo_err"] <= TOL and p["plain_err"] <= TOL, where
        assert p["dbo_vs_plain"] <= SAME and p["no_grad_vs_plain"] <= SAME, where


# ---- single process ------------------------------------------------------------------------


def test_first_forward_hook_leaves_other_models_alone():
    # the pre-hook held for a loaded model's first forward passes other modules through untouched
    # and goes once its experts are gone
    import gc

    import torch

    from dbo.integrations.transformers import fsdp as hf_fsdp

    experts = torch.nn.Linear(2, 2)
    hf_fsdp.prepare_at_first_forward(experts)
    assert hf_fsdp.pending_first_forward()
    other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    x = torch.ones(1, 2)
    with torch.inference_mode():
        assert torch.equal(other(x), other[1](other[0](x)))
    assert hf_fsdp.pending_first_forward()  # no FSDP unit holds the experts: still waiting
    assert hf_fsdp.prepare_for_overlap(other) is other  # no FSDP: a no-op
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hf_fsdp.prepare_for_overlap(object())
    del experts
    gc.collect()
    other(x)
    assert not hf_fsdp.pending_first_forward()


def _forward_order_job(path: str) -> list[int]:
    import torch
    import torch.distributed as dist

    from dbo.integrations.transformers import DBOPrefill, prefill_logits

    model = _load(path, "all2all")
    ids, mask = _inputs(dist.get_rank())
    sizes = []

    def recorded() -> int:  # FSDP's record of its units' forwards (made at the first forward)
        return len(model._get_fsdp_state()._comm_ctx.post_forward_order)

    with torch.no_grad():
        for _ in range(3):
            prefill_logits(model, ids, mask)
            sizes.append(recorded())
        DBOPrefill(model)(ids, mask)
        sizes.append(recorded())
    return sizes


def test_forwards_without_autograd_leave_no_forward_order_behind(world2, checkpoint):
    # FSDP records each unit's forward for a backward that inference never runs: left alone, the
    # record grows by one entry per unit per forward, without bound
    for rank, sizes in enumerate(world2.run(_forward_order_job, checkpoint, timeout_s=120)):
        assert sizes == [0, 0, 0, 0], f"rank {rank}: {sizes}"
