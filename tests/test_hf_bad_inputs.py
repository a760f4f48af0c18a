"""Bad checkpoints and bad configs on the transformers path end in one named error on every rank.

2 gloo ranks (``DBO_TEST_DIST_BACKEND=nccl``: 2 NCCL ranks on 2 GPUs), a tiny random-weight
Qwen3-MoE checkpoint (``write_random_checkpoint``, float32,
cut into many small shards) loaded expert-parallel with ``from_pretrained(ckpt,
distributed_config=ep_distributed_config(backend))``, or a tiny model converted with
``convert_to_expert_parallel``. Each case breaks one thing: a shard listed in the index but
absent, a truncated shard, one expert's weights missing from one layer, a tensor of the wrong
shape (both read by one rank only: the other rank's experts are intact), an expert count that 2
ranks cannot split, a model with no MoE block, an unknown backend name, a DistributedConfig for
another world size. Each asserts that every rank raised (none hangs, none returns a model), that
the error is one of the project's named errors or a ValueError/TypeError (a caller mistake), that
its message names the file, key or number at fault, and that the run ended within 10x its
expected time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from dbo.testing.dist import DistWorld

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

import torch  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

EXPECTED_S = 10.0  # a tiny load (or a refusal) on 2 ranks of a loaded 2-core machine
LAYER = 1  # the layer broken in the per-expert cases
EXPERT = 5  # held by rank 1 of 2 (experts 4..7 of 8): rank 0 reads none of it
EXPERT_KEY = f"model.layers.{LAYER}.mlp.experts.{EXPERT}.down_proj.weight"


#: ``nccl`` runs the cases on 2 GPUs, a rank each (``bash tests/gpu/run.sh hfbad``); default gloo
BACKEND = os.environ.get("DBO_TEST_DIST_BACKEND", "gloo")


@pytest.fixture(scope="module")
def world(worlds):
    if BACKEND == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("DBO_TEST_DIST_BACKEND=nccl needs 2 GPUs")
    # the group's own timeout is well above the test's bound: a rank left waiting in a
    # collective must be released by the library's agreement, not by the group giving up
    return worlds(2, backend=BACKEND, pg_timeout_s=10 * EXPECTED_S)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    from dbo.integrations.transformers.checkpoint import write_random_checkpoint
    from dbo.integrations.transformers.presets import tiny_config

    return write_random_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("good") / "ckpt",
                                   dtype=torch.float32, seed=1, max_shard_bytes=4096)


def _copy(good: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(good, out)
    return out


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _shard_of(path: Path, key: str) -> Path:
    return path / _index(path)["weight_map"][key]


def _rewrite(path: Path, key: str, tensor: torch.Tensor | None) -> Path:
    """Rewrite the shard holding ``key`` with ``tensor`` in its place (None: without it, and
    without its entry in the index); returns the shard."""
    from safetensors.torch import load_file, save_file

    shard = _shard_of(path, key)
    tensors = load_file(shard)
    if tensor is None:
        del tensors[key]
        index = _index(path)
        del index["weight_map"][key]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[key] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _describe(exc: BaseException) -> dict:
    from dbo.errors import DBOError

    return {"type": type(exc).__name__, "message": str(exc),
            "named": isinstance(exc, DBOError | ValueError | TypeError)}


def _load_job(path: str, backend: str = "all2all", world_size: int | None = None) -> dict:
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.testing.hf import load_float32

    try:
        load_float32(path, ep_distributed_config(backend, world_size))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _describe(exc)
    return {"type": None, "message": "loaded", "named": False}


def _convert_job(family: str, backend: str) -> dict:
    from dbo.integrations.transformers import convert_to_expert_parallel

    torch.manual_seed(0)
    if family == "dense":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=8))
    else:  # "qwen3_moe" or "qwen3_moe:<num_experts>"
        from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

        name, _, experts = family.partition(":")
        model = causal_lm_class(name)(tiny_config(name, num_experts=int(experts or 8)))
    try:
        convert_to_expert_parallel(model, backend=backend)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _describe(exc)
    return {"type": None, "message": "converted", "named": False}


def _run(world: DistWorld, fn, *args) -> list[dict]:
    t0 = time.monotonic()
    results = world.run(fn, *args, timeout_s=10 * EXPECTED_S)
    elapsed = time.monotonic() - t0
    assert elapsed < 10 * EXPECTED_S, f"{elapsed:.1f} s"
    return results


def _assert_every_rank_raised(results: list[dict], *names: str, error: str | None = None) -> None:
    for rank, r in enumerate(results):
        assert r["type"] is not None, f"rank {rank} did not raise ({r['message']})"
        assert r["named"], f"rank {rank}: {r['type']} is not a named error: {r['message']}"
        if error is not None:
            assert r["type"] == error, f"rank {rank}: {r['type']}: {r['message']}"
        for name in names:
            assert name in r["message"], f"rank {rank}: {name!r} not in {r['type']}: {r['message']}"


def test_missing_shard_file(world, good_checkpoint, tmp_path):
    path = _copy(good_checkpoint, tmp_path)
    shard = _shard_of(path, EXPERT_KEY)
    shard.unlink()
    _assert_every_rank_raised(_run(world, _load_job, str(path)), shard.name)


def test_truncated_shard_file(world, good_checkpoint, tmp_path):
    path = _copy(good_checkpoint, tmp_path)
    shard = _shard_of(path, EXPERT_KEY)
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    _assert_every_rank_raised(_run(world, _load_job, str(path)), shard.name)


def test_expert_missing_from_one_layer(world, good_checkpoint, tmp_path):
    path = _copy(good_checkpoint, tmp_path)
    _rewrite(path, EXPERT_KEY, None)
    _assert_every_rank_raised(_run(world, _load_job, str(path)), EXPERT_KEY)


def test_tensor_of_the_wrong_shape(world, good_checkpoint, tmp_path):
    from safetensors.torch import load_file

    path = _copy(good_checkpoint, tmp_path)
    good = load_file(_shard_of(path, EXPERT_KEY))[EXPERT_KEY]
    bad = torch.zeros(good.shape[0], good.shape[1] + 1)
    _rewrite(path, EXPERT_KEY, bad)
    want = f"{tuple(good.shape)}"
    _assert_every_rank_raised(_run(world, _load_job, str(path)), EXPERT_KEY, want)


def test_experts_not_divisible_by_world_size(world, tmp_path):
    from dbo.integrations.transformers.checkpoint import write_random_checkpoint
    from dbo.integrations.transformers.presets import tiny_config

    path = write_random_checkpoint(tiny_config("qwen3_moe", num_experts=5), tmp_path / "ckpt",
                                   dtype=torch.float32)
    _assert_every_rank_raised(_run(world, _load_job, str(path)), "5", "2")
    _assert_every_rank_raised(_run(world, _convert_job, "qwen3_moe:5", "all2all"), "5", "2")


def test_model_with_no_moe_block(world):
    _assert_every_rank_raised(_run(world, _convert_job, "dense", "all2all"), "Qwen3ForCausalLM",
                              error="UnsupportedModelError")


def test_unknown_backend_name(world, good_checkpoint):
    _assert_every_rank_raised(_run(world, _load_job, str(good_checkpoint), "no_such_backend"),
                              "no_such_backend", "all2all")
    _assert_every_rank_raised(_run(world, _convert_job, "qwen3_moe", "no_such_backend"),
                              "no_such_backend", "all2all")


def test_world_size_that_does_not_match_the_config(world, good_checkpoint):
    _assert_every_rank_raised(_run(world, _load_job, str(good_checkpoint), "all2all", 4), "4", "2")


def _check_job(good: str, bad: str) -> dict:
    import torch.distributed as dist

    from dbo.integrations.transformers.checkpoint import check_checkpoint

    try:
        check_checkpoint(bad if dist.get_rank() == 1 else good, 8)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _describe(exc)
    return {"type": None, "message": "passed", "named": False}


def test_a_rank_that_alone_sees_a_broken_file_stops_its_peers(world, good_checkpoint, tmp_path):
    # rank 1 sees a truncated shard where rank 0 sees a whole one (hosts without a shared file
    # system): both raise, rank 0 naming rank 1, and neither waits for the other
    path = _copy(good_checkpoint, tmp_path)
    shard = _shard_of(path, EXPERT_KEY)
    shard.write_bytes(shard.read_bytes()[:-1])
    results = _run(world, _check_job, str(good_checkpoint), str(path))
    _assert_every_rank_raised(results, error="CheckpointError")
    assert shard.name in results[1]["message"]
    assert "rank 1" in results[0]["message"]
    # and a whole checkpoint passes on both
    assert _run(world, _check_job, str(good_checkpoint), str(good_checkpoint)) == [
        {"type": None, "message": "passed", "named": False}] * 2
