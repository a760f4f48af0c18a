"""Random-weight transformers checkpoints, written in parallel by the ranks of a process group.

``write_random_checkpoint(config, directory)`` writes what ``save_pretrained`` would write for a
model of ``config`` with random weights (sharded safetensors, ``model.safetensors.index.json``
and ``config.json``), without ever building the model: a full-size Qwen3-30B-A3B (61 GB in
bf16) is written by every GPU of a host at once, each drawing its share of the tensors on its
own device, one shard at a time.

- **names and shapes** come from the model class itself, built on the meta device (no memory).
  The default ``layout="checkpoint"`` writes the key layout of the Hub and of ``save_pretrained``
  (per-expert ``...mlp.experts.{i}.gate_proj.weight``, Mixtral's ``...experts.{i}.w1.weight``):
  transformers' own reverse weight conversion (the one ``save_pretrained`` applies) maps the
  in-memory names to them, and ``from_pretrained`` converts them back (fusing the experts into
  ``gate_up_proj`` / ``down_proj``), as it does for a checkpoint from the Hub.
  ``layout="model"`` writes the in-memory names (fused 3-D experts), which transformers >= 5.23
  loads too, without a conversion.
- **shards**: the non-layer tensors (embeddings, final norm, lm_head) form the first shard, then
  each decoder layer (``...layers.{i}.``) its own, cut in order into pieces of at most
  ``max_shard_bytes`` (a DeepSeek-V3 MoE layer is 23 GB). The shards do not depend on the group
  size; each rank writes the shards assigned to it (largest first, to the rank with the fewest
  bytes so far), one at a time: a rank holds one shard on its device and, while writing it, in
  host memory.
- **values**: 1-D tensors whose name holds ``norm`` are ones, tensors whose name ends in ``bias``
  zeros (DeepSeek-V3's ``e_score_correction_bias``), everything else N(0, ``std``) (default:
  ``config.initializer_range``, else 0.02), drawn by a generator of its own seeded from ``seed``
  and the tensor's checkpoint name: the same checkpoint for any group size. CPU and CUDA
  generators draw different numbers, so a checkpoint written on GPUs differs from one written on
  CPUs with the same seed.

Collective: every rank of ``group`` calls it with the same arguments, and all must see the same
``directory`` (one host, or a shared file system). It returns once the directory is complete on
every rank. The files of a checkpoint already in ``directory`` (``model*.safetensors``, the
index, ``config.json``) are removed first, and ``config.json`` is written last: a directory with
one holds a complete checkpoint.

``check_checkpoint(directory, num_experts, group)`` is the reading side: before an
expert-parallel load, every rank reads the safetensors headers (not the tensors) and all agree
that the files are whole and every MoE layer holds all its experts' weights, in one shape. Each
rank reads only its own experts' tensors afterwards, so without it a broken expert would stop
the rank that holds it and let the others load a model that then waits for that rank.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import json
import math
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.errors import CheckpointError
from dbo.peers.collectives import all_reduce_max, collective_device, group_size

__all__ = ["write_random_checkpoint", "checkpoint_shards", "check_checkpoint",
           "check_checkpoint_being_loaded"]

INDEX_NAME = "model.safetensors.index.json"
LAYOUTS = ("checkpoint", "model")
_LAYER = re.compile(r"^(.*?\.layers\.(\d+))\.")
# an expert's own tensor (the Hub's layout: ...experts.{i}.gate_proj.weight, Mixtral's .w1.weight)
# and a layer's fused experts (the in-memory layout: ...experts.gate_up_proj [E, 2I, hidden])
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")
_FUSED_KEY = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      layout: str) -> dict[str, torch.Tensor]:
    if layout == "model":
        return state
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))


def checkpoint_shards(config: Any, *, dtype: torch.dtype = torch.bfloat16, layout: str = "checkpoint",
                      max_shard_bytes: int = 5 * 2**30) -> list[dict[str, tuple[int, ...]]]:
    """The shards :func:`write_random_checkpoint` writes for ``config``: one ``{name: shape}`` per
    file, in file order (the non-layer tensors first, then layer by layer). Builds nothing."""
    _check(config, dtype, layout, max_shard_bytes)
    model = _meta_model(config)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        if name in tied:
            continue
        m = _LAYER.match(name)
        groups.setdefault(int(m.group(2)) if m else -1, {})[name] = t
    shards: list[dict[str, tuple[int, ...]]] = []
    for key in sorted(groups):
        shard: dict[str, tuple[int, ...]] = {}
        size = 0
        for name, t in _checkpoint_names(model, groups[key], layout).items():
            nbytes = t.numel() * dtype.itemsize
            if shard and size + nbytes > max_shard_bytes:
                shards.append(shard)
                shard, size = {}, 0
            shard[name] = tuple(t.shape)
            size += nbytes
        if shard:
            shards.append(shard)
    return shards


def _check(config: Any, dtype: Any, layout: str, max_shard_bytes: Any) -> None:
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")


def assign_shards(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each shard: largest first, to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   seed: int, std: float) -> torch.Tensor:
    parts = name.split(".")
    if len(shape) == 1 and "norm" in (parts[-2] if len(parts) > 1 else name):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_random_checkpoint(config: Any, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                            device: str | torch.device | None = None, group: Any = None, seed: int = 0,
                            std: float | None = None, layout: str = "checkpoint",
                            max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a random-weight checkpoint of ``config``'s causal LM to ``directory``; return its path.

    Collective over ``group`` (default: the default group if ``torch.distributed`` is
    initialized, else this process alone): each rank draws its shards on ``device`` (default
    CPU; pass its GPU) and writes them with ``safetensors``; rank 0 writes the index and
    ``config.json`` (a copy of ``config`` with ``dtype``). ``from_pretrained(directory)`` loads it
    without missing or unexpected keys, whole or expert-parallel. See the module docstring for
    the layout, the shards and the values.
    """
    _check(config, dtype, layout, max_shard_bytes)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    std = float(getattr(config, "initializer_range", 0.02) if std is None else std)
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    device = torch.device("cpu" if device is None else device)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} exists and is not a directory")
    distributed = dist.is_available() and dist.is_initialized()
    if group is not None and not distributed:
        raise ValueError("group given but torch.distributed is not initialized")
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1

    def agree(phase: Callable[[], None], what: str) -> None:
        # every rank runs its part of the phase, then all learn whether any failed: a rank that
        # raised re-raises, the others raise naming it (no rank waits for a failed peer)
        failed: BaseException | None = None
        try:
            phase()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the peers
            failed = exc
        if distributed:
            flag = torch.tensor([rank + 1 if failed is not None else 0], dtype=torch.int64,
                                device=collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            first = int(flag.item()) - 1
        else:
            first = rank if failed is not None else -1
        if failed is not None:
            raise failed
        if first >= 0:
            raise RuntimeError(f"write_random_checkpoint: rank {first} failed while {what}; "
                               f"{str(directory)!r} is incomplete (no config.json)")

    shards = checkpoint_shards(config, dtype=dtype, layout=layout, max_shard_bytes=max_shard_bytes)
    sizes = [sum(math.prod(s) for s in shard.values()) * dtype.itemsize for shard in shards]
    owner = assign_shards(sizes, world)

    def clear() -> None:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            for old in [*directory.glob("model*.safetensors"), directory / INDEX_NAME,
                        directory / "config.json"]:
                old.unlink(missing_ok=True)

    def write_shards() -> None:
        from safetensors.torch import save_file

        for i, shard in enumerate(shards):
            if owner[i] != rank:
                continue
            tensors = {name: _random_tensor(name, shape, dtype, device, seed, std)
                       for name, shape in shard.items()}
            save_file(tensors, str(directory / _shard_name(i, len(shards))), metadata={"format": "pt"})
            del tensors

    def write_index() -> None:
        if rank == 0:
            weight_map = {name: _shard_name(i, len(shards)) for i, shard in enumerate(shards)
                          for name in shard}
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            saved = copy.deepcopy(config)
            saved.dtype = dtype
            saved.save_pretrained(directory)

    agree(clear, "clearing the directory")
    agree(write_shards, "writing its shards")
    agree(write_index, "writing the index and config.json")
    return directory



def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from a safetensors file's header, after checking that the file is as
    long as its header says (a truncated file is not)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise CheckpointError(f"{path}: {size} bytes, shorter than its safetensors header "
                                  "(truncated?)")
        try:
            header = json.loads(f.read(length))
            entries = {k: v for k, v in header.items() if k != "__metadata__"}
            shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in entries.items()}
            end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if 8 + length + end != size:
        raise CheckpointError(f"{path}: {size} bytes, its header describes {8 + length + end} "
                              "(truncated?)")
    return shapes


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if not index.is_file():
        single = directory / "model.safetensors"
        return [single] if single.is_file() else []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({exc})") from None
    absent = [n for n in names if not (directory / n).is_file()]
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise CheckpointError(f"{directory}: {absent[0]}{more} is listed in {INDEX_NAME} but absent")
    return [directory / n for n in names]


def _check_experts(directory: Path, shapes: dict[str, tuple[tuple[int, ...], str]],
                   num_experts: int) -> None:
    per_expert: dict[tuple[str, str], dict[int, tuple[tuple[int, ...], str]]] = {}
    for key, (shape, file) in shapes.items():
        fused = _FUSED_KEY.match(key)
        if fused and (not shape or shape[0] != num_experts):
            raise CheckpointError(f"{file}: {key} has shape {shape}; the model has {num_experts} "
                                  "experts in its first dimension")
        m = _EXPERT_KEY.match(key)
        if m:
            per_expert.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = (shape, file)
    for (prefix, rest), found in sorted(per_expert.items()):
        absent = [e for e in range(num_experts) if e not in found]
        if absent:
            raise CheckpointError(
                f"{directory}: {prefix}.{absent[0]}.{rest} is missing: the checkpoint holds "
                f"{len(found)} of the layer's {num_experts} experts' {rest} (absent: {absent})")
        extra = sorted(e for e in found if e >= num_experts)
        if extra:
            raise CheckpointError(f"{found[extra[0]][1]}: {prefix}.{extra[0]}.{rest}: expert {extra[0]}, "
                                  f"the model has {num_experts} experts (0..{num_experts - 1})")
        counts: dict[tuple[int, ...], int] = {}
        for shape, _ in found.values():
            counts[shape] = counts.get(shape, 0) + 1
        usual = max(counts, key=lambda s: counts[s])
        for e, (shape, file) in sorted(found.items()):
            if shape != usual:
                raise CheckpointError(f"{file}: {prefix}.{e}.{rest} has shape {shape}, expected "
                                      f"{usual} (the layer's other experts' shape)")


def check_checkpoint(directory: str | Path, num_experts: int, group: Any = None) -> None:
    """Check, before loading it expert-parallel, that the safetensors checkpoint in ``directory``
    can be loaded by every rank: each file its index lists is present and as long as its header
    says, and every layer holds each of its ``num_experts`` experts' tensors, all of one shape
    (or fused ``[num_experts, ...]`` tensors). Reads the headers only.

    Collective over ``group`` (default: the default group, if any): every rank checks, then all
    agree, so that all raise or none does (a rank that found nothing wrong raises naming the
    rank that did). A directory with no safetensors files passes (nothing to check).

    Raises:
        CheckpointError: the first problem found, naming the file or key and what was expected.
    """
    directory = Path(directory)
    failed: CheckpointError | None = None
    try:
        shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in _checkpoint_files(directory):
            shapes.update({k: (s, str(file)) for k, s in _header_shapes(file).items()})
        _check_experts(directory, shapes, num_experts)
    except CheckpointError as exc:
        failed = exc
    except OSError as exc:  # a file that vanished or cannot be read
        failed = CheckpointError(f"{directory}: {exc}")
    if group_size(group) > 1:
        rank = dist.get_rank(group)
        first = all_reduce_max([rank + 1 if failed is not None else 0], group,
                               phase="checkpoint check")[0] - 1
    else:
        first = -1
    if failed is not None:
        raise failed
    if first >= 0:
        raise CheckpointError(f"{directory}: rank {first} cannot load this checkpoint (its error "
                              "names the file or key); no rank loads it")


#: what transformers calls the function that builds the EP implementations, and its argument
#: that holds the model (nothing public hands the model to an implementation):
#: tests/test_hf_checkpoint.py pins both against the installed transformers
EP_BUILDER = ("transformers.distributed.expert_parallel", "apply_expert_parallelism", "model")


def _model_being_distributed() -> torch.nn.Module | None:
    """The model whose EP implementations transformers is building (the caller's caller's ...
    call of ``EP_BUILDER``), or None outside such a call or without that function."""
    module, function, argument = EP_BUILDER
    try:
        builder = inspect.unwrap(getattr(importlib.import_module(module), function))
    except (ImportError, AttributeError):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is builder.__code__:
            model = frame.f_locals.get(argument)
            return model if isinstance(model, torch.nn.Module) else None
        frame = frame.f_back
    return None


def check_checkpoint_being_loaded(num_experts: int, group: Any = None) -> None:
    """:func:`check_checkpoint` on the directory that ``from_pretrained(path,
    distributed_config=...)`` is loading, called while transformers builds the model's
    expert-parallel implementations (before any weight is read): once per model, at its first
    experts module. Collective over ``group``, as every rank builds the same modules in order.
    Does nothing for a checkpoint that is not a local directory (a Hub id) or a model that is
    not loaded from one; warns (the check is off) where it finds no model being distributed:
    called outside transformers' ``EP_BUILDER``, or a transformers that renamed it.

    Raises:
        CheckpointError: as :func:`check_checkpoint`.
    """
    model = _model_being_distributed()
    if model is None:
        warnings.warn(f"no model is being distributed by {'.'.join(EP_BUILDER[:2])}({EP_BUILDER[2]}, "
                      "...) on the stack (called elsewhere, or transformers renamed it): the "
                      "checkpoint is not checked before loading", RuntimeWarning, stacklevel=2)
        return
    if getattr(model, "_dbo_checkpoint_checked", False):
        return
    model._dbo_checkpoint_checked = True
    path = getattr(getattr(model, "config", None), "name_or_path", None)
    if path and Path(path).is_dir():
        check_checkpoint(path, num_experts, group)
