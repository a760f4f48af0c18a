"""The transformers benchmarks' model: built expert-parallel on the meta device and materialised
with seeded random weights, or written as a random checkpoint and loaded expert-parallel.

:func:`build_model` builds the model from its config alone on the meta device, converts it
(:func:`~dbo.integrations.transformers.convert_to_expert_parallel`: each MoE layer keeps this
rank's slice of the experts) and materialises only what this rank holds, with random weights drawn
from per-tensor (per-expert for the experts) seeds: every rank and the unconverted model get the
same weights without any rank ever holding all experts. :func:`save_checkpoint` writes a random
checkpoint (every rank its share), :func:`load_checkpoint` loads one with ``from_pretrained``,
expert-parallel with dbo's backend as transformers' EP implementation, or whole.
"""

from __future__ import annotations

import json
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dbo.backends import BACKENDS
from dbo.backends.emulated import EmulatedGroup
from dbo.bench.limits import rate_text
from dbo.integrations.transformers import convert_to_expert_parallel
from dbo.integrations.transformers.checkpoint import write_random_checkpoint
from dbo.integrations.transformers.ep import ep_distributed_config
from dbo.integrations.transformers.ep_model import expert_parallel_modules
from dbo.integrations.transformers.moe_block import ExpertParallelMoE
from dbo.integrations.transformers.presets import PRESETS, causal_lm_class
from dbo.peers.collectives import all_reduce_max

__all__ = ["family", "materialise", "build_model", "alone", "save_checkpoint", "shared_temporary_dir",
           "load_checkpoint", "load_hf_all_to_all", "backend_kwargs", "reset_layers", "peak_gib",
           "reset_peak"]


def family(preset: str) -> str:
    """The model family (``qwen3_moe``, ...) of a preset name (``tiny-qwen3_moe``, ``qwen3-30b-a3b``)."""
    return preset.removeprefix("tiny-") if preset.startswith("tiny-") else PRESETS[preset][0]


def _seeded(t: torch.Tensor, key: str, seed: int, std: float) -> None:
    g = torch.Generator(device=t.device).manual_seed(zlib.crc32(key.encode()) * 1000 + seed)
    t.normal_(0.0, std, generator=g)


def materialise(model: torch.nn.Module, device: torch.device, seed: int, std: float) -> None:
    """Allocate ``model``'s (meta) tensors on ``device`` and fill them: norms 1, biases 0, other
    weights N(0, std) from seeds named after the tensor (and the global expert), so that the
    converted model and the original get the same numbers."""
    model.to_empty(device=device)
    experts = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ExpertParallelMoE):
            experts[f"{name}.w1"] = (f"{name}.experts.gate_up_proj", mod.first_expert)
            experts[f"{name}.w2"] = (f"{name}.experts.down_proj", mod.first_expert)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in experts or (name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3):
                key, first = experts.get(name, (name, 0))
                for i in range(p.shape[0]):
                    _seeded(p[i], f"{key}[{first + i}]", seed, std)
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                _seeded(p, name, seed, std)
        for mod in model.modules():
            own = dict(mod.named_buffers(recurse=False))
            if "inv_freq" in own:  # a rotary embedding: the buffers its __init__ computes
                fresh = dict(type(mod)(mod.config).named_buffers(recurse=False))
                for bname, buf in own.items():
                    buf.copy_(fresh[bname].to(buf.device, buf.dtype))
            else:
                for buf in own.values():
                    buf.zero_()  # e.g. DeepSeek's e_score_correction_bias


def build_model(preset: str, config: Any, dtype: torch.dtype, device: torch.device, *, seed: int,
                convert: bool, group: Any = None) -> torch.nn.Module:
    """``preset``'s causal LM of ``config`` in ``dtype`` on ``device``, in eval mode, with seeded
    random weights; ``convert``: expert-parallel over ``group`` (None: the default group; its
    backend ``naive`` until :func:`~dbo.integrations.transformers.use_backend` picks one; an
    :class:`~dbo.backends.emulated.EmulatedGroup`: that rank's experts only, with no process
    group, its backend ``emulated``), else whole."""
    with torch.device("meta"):
        model = causal_lm_class(family(preset))(config)
    model = model.to(dtype).eval()
    if convert:  # on meta: slicing the experts allocates nothing
        if isinstance(group, EmulatedGroup):
            convert_to_expert_parallel(model, group, backend="emulated", layout="deepep_ht",
                                       max_tokens_per_rank=1)
        else:
            convert_to_expert_parallel(model, group, backend="naive")
    materialise(model, device, seed, getattr(config, "initializer_range", 0.02))
    return model


def save_checkpoint(config: Any, directory: str, dtype: torch.dtype, device: torch.device, seed: int,
                    rank: int) -> None:
    """Every rank writes its share of a random-weight checkpoint of ``config`` to ``directory``,
    drawn on ``device`` (:func:`~dbo.integrations.transformers.checkpoint.write_random_checkpoint`:
    sharded safetensors in the Hub's key layout, an index and config.json; the model is never
    built). Rank 0 prints the time and the bytes written."""
    t0 = time.perf_counter()
    path = write_random_checkpoint(config, directory, dtype=dtype, device=device, seed=seed)
    seconds = time.perf_counter() - t0
    if rank == 0:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        size, files = index["metadata"]["total_size"], len(set(index["weight_map"].values()))
        print(f"wrote {path}: {rate_text(size, 'B')} ({size:,} bytes) of random "
              f"{str(dtype).removeprefix('torch.')} weights in {files} files on {dist.get_world_size()} "
              f"ranks, {seconds:.1f} s ({rate_text(size / seconds, 'B/s')})", flush=True)


def shared_temporary_dir(prefix: str) -> str:
    """A new empty directory under the system's temp dir, made by rank 0 of the default group,
    whose path every rank gets (collective). For a checkpoint that a run writes and reads on
    one host (other hosts would not see it); rank 0 removes it once every rank is done with it."""
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def alone(device: str) -> torch.device:
    """The device of a run with no process group (an emulated rank): the CPU, or the current GPU
    (made current, as a rank's is)."""
    if device != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    return dev


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak GPU memory allocated since :func:`reset_peak` (GiB); None on the CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _timed_load(load: Callable[[], torch.nn.Module], device: torch.device, what: str) -> torch.nn.Module:
    """``load()`` in eval mode, printing (rank 0) its seconds (slowest rank) and, on CUDA, the
    fullest rank's peak GPU memory."""
    reset_peak(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    model = load()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, peak = all_reduce_max([time.perf_counter() - t0, peak_gib(device) or 0.0],
                                   phase="checkpoint load")
    if dist.get_rank() == 0:
        memory = f", peak {peak:.2f} GiB per GPU (fullest rank)" if device.type == "cuda" else ""
        print(f"load ({what}): from_pretrained {seconds:.1f} s (slowest rank){memory}", flush=True)
    return model.eval()


def load_checkpoint(path: str, dtype: torch.dtype, device: torch.device, *,
                    backend: str | None) -> torch.nn.Module:
    """``from_pretrained(path)``: expert-parallel with dbo's ``backend`` as transformers' EP
    implementation (each rank reads its experts only), or whole on every rank (``backend=None``)."""
    from transformers import AutoModelForCausalLM

    if backend is None:
        kw: dict[str, Any] = {"device_map": device}
        what = "whole"
    else:
        kw = {"distributed_config": ep_distributed_config(backend, dist.get_world_size())}
        what = f"dbo_{backend} expert-parallel"
    return _timed_load(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw), device, what)


def load_hf_all_to_all(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``from_pretrained(path)`` expert-parallel with transformers' own ``all_to_all``
    implementation (run it under ``no_grad``: it fails under inference mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    cfg = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    return _timed_load(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                                    distributed_config=cfg),
                       device, "transformers all_to_all")


def backend_kwargs(name: str, *, max_tokens_per_rank: int, link: Any = None) -> dict[str, Any]:
    """The options :func:`~dbo.integrations.transformers.use_backend` passes to backend ``name``:
    ``max_tokens_per_rank`` where the backend is sized by it, ``link`` (a ``SimulatedLink``) where
    one is given."""
    options: dict[str, Any] = {}
    if BACKENDS[name].needs_max_tokens:
        options["max_tokens_per_rank"] = max_tokens_per_rank
    if link is not None:
        options["link"] = link
    return options


def reset_layers(model: torch.nn.Module) -> None:
    """Drop the per-ubatch state of every expert-parallel layer of ``model`` (converted or loaded)."""
    model.apply(lambda m: m.reset() if isinstance(m, ExpertParallelMoE) else None)
    for _, impl in expert_parallel_modules(model):
        impl.reset()
