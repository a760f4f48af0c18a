"""Random-weight checkpoints written by ``dbo.integrations.transformers.checkpoint.write_random_checkpoint``.

Tiny Qwen3-MoE and DeepSeek-V3 configs, written in one process and by 2 gloo ranks: the
directory loads through ``from_pretrained`` with no missing, unexpected or mismatched keys; the
loaded weights are the written ones (the per-expert keys fused into ``gate_up_proj`` /
``down_proj``, checked by hand for one layer's experts and through transformers' reverse
conversion for everything); 2 ranks write the same tensors and index as 1; a model loaded from
it expert-parallel (``ep_distributed_config("all2all")``) gives the whole model's logits
(float32). Also: the in-memory key layout, bf16 and the shard size limit, tied embeddings, old
model files replaced, reproducible seeds, caller mistakes.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from dbo.integrations.transformers.checkpoint import checkpoint_shards, write_random_checkpoint  # noqa: E402
from dbo.integrations.transformers.presets import tiny_config  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.dist_world(pg_timeout_s=60.0)]

FAMILIES = ("qwen3_moe", "deepseek_v3")
TOL = 1e-5  # float32, relative to the largest logit


def _files(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    return model.eval(), info


def _assert_complete(info) -> None:
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info[key])


@pytest.mark.parametrize("family", FAMILIES)
def test_written_checkpoint_loads_with_the_written_weights(tmp_path, family):
    from transformers.core_model_loading import revert_weight_conversion

    config = tiny_config(family)
    out = write_random_checkpoint(config, tmp_path / "ckpt", dtype=torch.float32, seed=3)
    assert out == tmp_path / "ckpt"
    files = _files(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in files.values())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in out.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text())["model_type"] == config.model_type

    model, info = _load(out)
    _assert_complete(info)
    # every tensor, through the reverse of the conversion from_pretrained applied
    state = revert_weight_conversion(model, model.state_dict())
    assert set(state) == set(files)
    for name, t in files.items():
        assert torch.equal(state[name], t), name
    # one MoE layer's experts by hand: the Hub's per-expert keys, fused
    layer = config.num_hidden_layers - 1
    experts = model.model.layers[layer].mlp.experts
    prefix = f"model.layers.{layer}.mlp.experts"
    assert f"{prefix}.0.gate_proj.weight" in files and f"{prefix}.gate_up_proj" not in files
    for e in range(experts.gate_up_proj.shape[0]):
        gate_up = torch.cat([files[f"{prefix}.{e}.gate_proj.weight"], files[f"{prefix}.{e}.up_proj.weight"]])
        assert torch.equal(experts.gate_up_proj[e], gate_up)
        assert torch.equal(experts.down_proj[e], files[f"{prefix}.{e}.down_proj.weight"])
    # the values: norms 1, biases 0, the rest N(0, initializer_range)
    assert torch.equal(files["model.norm.weight"], torch.ones(config.hidden_size))
    assert all(t.eq(0).all() for n, t in files.items() if n.endswith("bias"))
    std = files["model.embed_tokens.weight"].std().item()
    assert abs(std - config.initializer_range) < 0.2 * config.initializer_range


def test_model_layout_bf16_and_shard_limit(tmp_path):
    config = tiny_config("qwen3_moe", layers=3)
    limit = 4096  # bytes: each layer is cut into several files
    shards = checkpoint_shards(config, layout="model", max_shard_bytes=limit)
    out = write_random_checkpoint(config, tmp_path, layout="model", max_shard_bytes=limit)
    files = _files(out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in files  # the in-memory names
    assert len(list(out.glob("*.safetensors"))) == len(shards) > 3 + 1
    for f in out.glob("*.safetensors"):
        part = _files_of(f)
        assert len(part) == 1 or sum(t.numel() * 2 for t in part.values()) <= limit, f.name
    assert {t.dtype for t in files.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = _load(out, torch.bfloat16)
    _assert_complete(info)
    for name, t in model.state_dict().items():
        assert torch.equal(t, files[name]), name


def _files_of(f) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f)


def test_tied_embeddings_are_written_once(tmp_path):
    config = tiny_config("qwen3_moe", tie_word_embeddings=True)
    files = _files(write_random_checkpoint(config, tmp_path, dtype=torch.float32))
    assert "lm_head.weight" not in files and "model.embed_tokens.weight" in files
    model, info = _load(tmp_path)
    _assert_complete(info)
    assert torch.equal(model.lm_head.weight, files["model.embed_tokens.weight"])


def test_seed_and_old_files(tmp_path):
    config = tiny_config("qwen3_moe")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.safetensors").write_bytes(b"old")  # would be loaded instead
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "a" / "notes.txt").write_text("kept")
    a = _files(write_random_checkpoint(config, tmp_path / "a", seed=1))
    b = _files(write_random_checkpoint(config, tmp_path / "b", seed=1))
    c = _files(write_random_checkpoint(config, tmp_path / "c", seed=2))
    assert not (tmp_path / "a" / "model.safetensors").exists()
    assert (tmp_path / "a" / "notes.txt").read_text() == "kept"
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[name], c[name])
    # a different shard split does not change the tensors
    d = _files(write_random_checkpoint(config, tmp_path / "d", seed=1, max_shard_bytes=2048))
    assert all(torch.equal(a[k], d[k]) for k in a)


@pytest.mark.parametrize("preset, tensors, total, files, per_rank", [
    ("qwen3-30b-a3b", 18867, 61_064_245_248, 49, 16.3e9),  # 48 layers
    ("deepseek-v3", 2361, 73_917_414_912, 17, 19.8e9),  # 4 layers, the first dense
], ids=["qwen3-30b-a3b", "deepseek-v3"])
def test_full_size_presets_are_planned_without_memory(preset, tensors, total, files, per_rank):
    from dbo.integrations.transformers.checkpoint import assign_shards
    from dbo.integrations.transformers.presets import preset_config

    shards = checkpoint_shards(preset_config(preset))  # built on the meta device
    sizes = [sum(torch.Size(s).numel() for s in shard.values()) * 2 for shard in shards]
    assert (sum(len(s) for s in shards), sum(sizes), len(shards)) == (tensors, total, files)
    assert max(sizes) <= 5 * 2**30
    owner = assign_shards(sizes, 4)
    assert max(sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(4)) <= per_rank


def test_caller_mistakes(tmp_path):
    config = tiny_config("qwen3_moe")
    with pytest.raises(TypeError, match="PretrainedConfig"):
        write_random_checkpoint({"hidden_size": 8}, tmp_path)
    with pytest.raises(TypeError, match="floating-point"):
        write_random_checkpoint(config, tmp_path, dtype=torch.int32)
    with pytest.raises(TypeError, match="floating-point"):
        write_random_checkpoint(config, tmp_path, dtype="bfloat16")
    with pytest.raises(ValueError, match="layout"):
        write_random_checkpoint(config, tmp_path, layout="fused")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_random_checkpoint(config, tmp_path, max_shard_bytes=0)
    with pytest.raises(TypeError, match="seed"):
        write_random_checkpoint(config, tmp_path, seed=1.5)
    with pytest.raises(ValueError, match="std"):
        write_random_checkpoint(config, tmp_path, std=0.0)
    with pytest.raises(ValueError, match="not initialized"):
        write_random_checkpoint(config, tmp_path, group=object())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        write_random_checkpoint(config, tmp_path / "file")


# ---- 2 gloo ranks ---------------------------------------------------------------------------


def _write_job(directory: str, family: str) -> list[str]:
    from pathlib import Path

    out = write_random_checkpoint(tiny_config(family), directory, dtype=torch.float32, seed=5,
                                  max_shard_bytes=8192)
    # complete when it returns, on every rank
    return sorted(p.name for p in Path(out).iterdir())


def _logits_job(directory: str) -> float:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dbo.deployment import DeploymentConfig
    from dbo.integrations.transformers import DBOPrefill
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.integrations.transformers.ep_model import expert_parallel_deployment, expert_parallel_modules
    from dbo.split import SplitConfig

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(11 + rank)
    ids = torch.randint(0, 64, ((3, 5)[rank], 9), generator=g)  # each rank its own batch
    whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # loaded for a tuned deployment: the model carries it, and DBOPrefill runs it
    tuned = DeploymentConfig(SplitConfig(decode_token_threshold=3), sbo_groups=4, sm_carveout=0)
    ep = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        distributed_config=ep_distributed_config("all2all", deployment=tuned)).eval()
    assert expert_parallel_deployment(ep) == tuned
    prefill = DBOPrefill(ep)
    assert prefill.wrapper.config == tuned.split and prefill.wrapper.options.sbo_groups == 4
    assert expert_parallel_deployment(whole) is None
    layers = expert_parallel_modules(ep)
    assert len(layers) == whole.config.num_hidden_layers
    assert layers[0][1].first_expert == rank * whole.config.num_experts // 2
    local = ep.model.layers[0].mlp.experts.gate_up_proj
    local = getattr(local, "to_local", lambda: local)()
    assert local.shape[0] == whole.config.num_experts // 2, local.shape
    with torch.inference_mode():
        want = whole(input_ids=ids).logits
        got = ep(input_ids=ids).logits
    assert want.std() > 0.1 * want.abs().max()  # not a constant
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_write_what_one_writes(world2, tmp_path, family):
    one = _write_job(str(tmp_path / "one"), family)
    assert world2.run(_write_job, str(tmp_path / "two"), family) == [one, one]
    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = "model.safetensors.index.json"
    assert (tmp_path / "one" / index).read_text() == (tmp_path / "two" / index).read_text()
    _, info = _load(tmp_path / "two")
    _assert_complete(info)


@pytest.mark.multiproc
def test_expert_parallel_load_gives_the_whole_models_logits(world2, tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    path = str(tmp_path / "ckpt")
    world2.run(_write_ckpt_job, path)
    errs = world2.run(_logits_job, path, timeout_s=120)
    assert max(errs) <= TOL, errs


def _write_ckpt_job(directory: str) -> None:
    # std 0.3: routing differs token to token
    write_random_checkpoint(tiny_config("qwen3_moe"), directory, dtype=torch.float32, seed=7, std=0.3)


def _write_with_a_failing_rank_job(directory: str) -> str:
    # rank 1 cannot write its shards (its disk is full): both ranks raise at once, rank 1 its
    # own error and rank 0 naming rank 1, and the directory has no config.json
    import safetensors.torch
    import torch.distributed as dist

    real = safetensors.torch.save_file
    if dist.get_rank() == 1:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        safetensors.torch.save_file = full
    try:
        write_random_checkpoint(tiny_config("qwen3_moe"), directory, dtype=torch.float32,
                                max_shard_bytes=8192)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        safetensors.torch.save_file = real  # the worker runs the module's other jobs too
    return "no error"


@pytest.mark.multiproc
def test_a_rank_that_fails_to_write_fails_every_rank(world2, tmp_path):
    path = str(tmp_path / "ckpt")
    errs = world2.run(_write_with_a_failing_rank_job, path, timeout_s=60)
    assert errs[0].startswith("RuntimeError") and "rank 1 failed while writing its shards" in errs[0], errs
    assert errs[1].startswith("OSError") and "No space left" in errs[1], errs
    assert not (tmp_path / "ckpt" / "config.json").exists()


# ---- the check before an expert-parallel load finds the model through transformers -----------


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "tp"))
    finally:
        dist.destroy_process_group()


def test_transformers_still_has_the_ep_builder_the_check_reads():
    # Nothing public hands an EP implementation its model: the check reads it off transformers'
    # call that builds them. Pinned here, so that a rename upstream fails this test loudly.
    import importlib
    import inspect

    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    from dbo.integrations.transformers.checkpoint import EP_BUILDER

    module, function, argument = EP_BUILDER
    builder = getattr(importlib.import_module(module), function, None)
    assert builder is not None, (f"transformers {transformers.__version__} has no {module}.{function}: "
                                 "find what builds the EP implementations now and update EP_BUILDER")
    params = list(inspect.signature(builder).parameters)
    assert params[:1] == [argument], (f"{module}.{function} takes {params}, no longer the model as "
                                      f"{argument!r}: update EP_BUILDER")


def test_the_check_runs_while_transformers_builds_the_ep_implementations(tmp_path, one_rank_mesh):
    # transformers' own builder with dbo's implementation, on a model whose checkpoint lists a
    # shard that is absent: the check stops it before any weight is read
    import importlib

    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    from transformers import AutoModelForCausalLM

    import dbo.integrations.transformers  # noqa: F401  (registers dbo's EP implementations)
    from dbo.errors import CheckpointError
    from dbo.integrations.transformers.checkpoint import EP_BUILDER

    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    model.config.name_or_path = str(tmp_path)
    plan = {n: "ep_dispatch_experts" for n, _ in model.named_modules() if n.endswith("mlp.experts")}
    builder = getattr(importlib.import_module(EP_BUILDER[0]), EP_BUILDER[1])
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors .* absent"):
        builder(model, one_rank_mesh["ep"], one_rank_mesh["tp"], plan, ep_implementation="dbo_all2all")


def test_the_check_warns_where_it_finds_no_model_being_distributed():
    from dbo.integrations.transformers.checkpoint import check_checkpoint_being_loaded

    with pytest.warns(RuntimeWarning, match="the checkpoint is not checked"):
        check_checkpoint_being_loaded(8)
