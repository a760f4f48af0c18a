"""The options the transformers benchmarks (``hf-prefill``, ``hf-generate``) share, and the checks
that answer a bad value in one line before any process group exists.

Every check here runs on every rank with the same inputs (the arguments, torchrun's
``WORLD_SIZE``, the checkpoint's ``config.json``), so under torchrun either every rank passes or
every rank exits 2 with the same line (:class:`dbo.bench.cli.ArgumentParser`), and none waits for
a peer.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dbo.backends import backend_spec
from dbo.bench.cli import (
    add_link_arguments,
    check_backend_fits,
    check_device,
    check_writable_file,
    check_writable_folder,
    env_world_size,
    parse_link,
)
from dbo.bench.hf.options import DTYPES, ModelOptions
from dbo.integrations.transformers.presets import PRESETS, TINY_FAMILIES, preset_config, tiny_config

__all__ = ["DTYPES", "PRESET_CHOICES", "backend_name", "add_model_arguments", "model_options", "check_model",
           "check_model_arguments", "default_checkpoint", "default_checkpoint_dir", "check_backends",
           "num_routed_experts", "model_config"]

PRESET_CHOICES = sorted(PRESETS) + [f"tiny-{f}" for f in TINY_FAMILIES]


def backend_name(text: str) -> str:
    """argparse type: a key of :data:`dbo.backends.BACKENDS` (checked by
    :func:`dbo.backends.backend_spec`, whose message lists them)."""
    try:
        backend_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_model_arguments(p: argparse.ArgumentParser, *,
                        without_checkpoint: str = "build --preset with random weights") -> None:
    """The model and where it runs: ``--device --preset --layers --dtype --checkpoint
    --save-checkpoint --link --remote-fraction --seed --json``. ``without_checkpoint``: what the
    command does when given neither checkpoint option (``--checkpoint``'s help states it)."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: cpu)")
    p.add_argument("--preset", choices=PRESET_CHOICES, default=None,
                   help="the model to build (default: tiny-qwen3_moe on CPU, qwen3-30b-a3b on CUDA)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the preset's; 2 for the tiny ones)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="(default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--checkpoint", default=None,
                   help="DIR (or a Hub model id): load this checkpoint expert-parallel with "
                        f"from_pretrained (transformers >= 5.23) (default: {without_checkpoint})")
    p.add_argument("--save-checkpoint", default=None,
                   help="DIR: first write --preset with random weights there (every rank its share: "
                        "dbo.integrations.transformers.checkpoint) and load it as --checkpoint")
    add_link_arguments(p)
    p.add_argument("--emulate-ep", type=int, default=None, metavar="N",
                   help="play one rank of an N-rank expert-parallel group on this one process, as plain "
                        "python (no torchrun, no process group): the model holds that rank's experts, "
                        "random weights; the emulated backend moves the rank's bytes in DeepEP's "
                        "high-throughput layout for the prefill and its low-latency one for the decode "
                        "steps, over --link; the rank's own tokens stand in for its peers'")
    p.add_argument("--emulate-rank", type=int, default=0,
                   help="with --emulate-ep: the rank played (default: 0)")
    p.add_argument("--gpus-per-host", type=int, default=8,
                   help="with --emulate-ep: ranks per host; bytes to other hosts cross --link (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")


def num_routed_experts(config: Any) -> int | None:
    """The routed experts of every MoE layer of a transformers MoE ``config`` (None: not found)."""
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _checkpoint_config(p: argparse.ArgumentParser, where: str) -> Any:
    """``--checkpoint``'s config, or ``p.error`` naming it and what is wanted."""
    path = Path(where).expanduser()
    if path.exists() or where.startswith((".", "/", "~")) or where.count("/") > 1:
        if not path.is_dir():
            p.error(f"--checkpoint {where}: no such directory; give a directory written by "
                    "save_pretrained (or --save-checkpoint DIR to write one)")
        if not (path / "config.json").is_file():
            p.error(f"--checkpoint {where}: no config.json there; give a directory written by "
                    "save_pretrained (or --save-checkpoint DIR to write one)")
    from transformers import AutoConfig

    quiet = [logging.getLogger(name) for name in ("huggingface_hub", "transformers")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:  # the reason goes into our one line; their retries' warnings would not
            log.setLevel(logging.ERROR)
        return AutoConfig.from_pretrained(str(path) if path.exists() else where)
    except (OSError, ValueError) as exc:  # not on the Hub, offline, or not a transformers config
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        p.error(f"--checkpoint {where}: cannot read its config ({reason}); give a directory written "
                "by save_pretrained or a Hub model id")
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def model_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> ModelOptions:
    """:func:`add_model_arguments`' options as a :class:`ModelOptions` value, the device's
    defaults filled in (``p.error`` on a bad value: a bad ``--layers``, ``--remote-fraction`` or
    ``--link``, both checkpoint options naming different directories, ``--device cuda`` without
    CUDA). What needs the files or the group (its config, its experts over the ranks) is
    :func:`check_model`'s."""
    check_device(p, args.device)
    cuda = args.device == "cuda"
    emulate = getattr(args, "emulate_ep", None)
    try:
        # an emulated rank moves its bytes in DeepEP's layouts, which carry bf16
        model = ModelOptions(
            device=args.device, preset=args.preset or ("qwen3-30b-a3b" if cuda else "tiny-qwen3_moe"),
            layers=args.layers, dtype=DTYPES[args.dtype or ("bfloat16" if cuda or emulate else "float32")],
            checkpoint=args.checkpoint or args.save_checkpoint, save_checkpoint=args.save_checkpoint,
            link=args.link, link_order=args.link_order, remote_fraction=args.remote_fraction,
            seed=args.seed, json=args.json, emulate_ep=emulate,
            emulate_rank=getattr(args, "emulate_rank", 0), gpus_per_host=getattr(args, "gpus_per_host", 8))
    except ValueError as exc:
        p.error(str(exc))
    return dataclasses.replace(model, link_model=parse_link(p, args))


def check_model(p: argparse.ArgumentParser, model: ModelOptions, *,
                always_loads: bool = False) -> ModelOptions:
    """``model`` with its ``config`` (the preset's, or read from ``--checkpoint``), after the
    checks of what it will write and need (``p.error`` on the first that fails): ``--json`` and
    ``--save-checkpoint`` writable, routed experts found and split evenly over the ranks (or over
    ``--emulate-ep``'s group, which runs as plain python, not under torchrun). A run
    that loads a checkpoint expert-parallel (``--checkpoint``, ``--save-checkpoint``, or every
    run where ``always_loads``) needs 2 or more ranks: at one rank transformers loads a model
    whole, and dbo's implementations would not run."""
    if model.json:
        check_writable_file(p, "--json", model.json)
    if model.save_checkpoint:
        check_writable_folder(p, "--save-checkpoint", model.save_checkpoint)
        config = model_config(model.preset, model.layers)
    elif model.checkpoint:
        config = _checkpoint_config(p, model.checkpoint)
    else:
        config = model_config(model.preset, model.layers)
    experts = num_routed_experts(config)
    if experts is None:
        p.error(f"{model.checkpoint or model.preset}: {type(config).__name__} names no routed "
                "experts; dbo runs Qwen3-MoE, Mixtral and DeepSeek-V3 models")
    world = env_world_size()
    if model.emulate_ep is not None:  # one process plays the rank: no group, no checkpoint
        n = model.emulate_ep
        if world > 1:
            p.error(f"--emulate-ep {n} under a group of {world} ranks: run it as plain python (one "
                    "process plays the rank, no torchrun)")
        if experts % n:
            p.error(f"--emulate-ep {n}: {model.preset}'s {experts} routed experts do not split evenly "
                    f"over {n} ranks; give a group size that divides {experts}")
        return dataclasses.replace(model, config=config)
    if world < 2 and (always_loads or model.checkpoint):
        given = "--save-checkpoint" if model.save_checkpoint else "--checkpoint"
        what = "loading the checkpoint" if always_loads else f"{given} {model.checkpoint}: loading it"
        p.error(f"{what} expert-parallel needs 2 or more ranks (torchrun --nproc-per-node N ...); at one "
                "rank transformers loads a model whole")
    if experts % world:
        p.error(f"{model.checkpoint or model.preset}: its {experts} routed experts do not split evenly "
                f"over {world} ranks; run a number of ranks that divides {experts}")
    return dataclasses.replace(model, config=config)


def check_model_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, *,
                          always_loads: bool = False) -> None:
    """For scripts that keep the parsed ``argparse.Namespace`` (the GPU runners, the probes):
    :func:`model_options` and :func:`check_model`, their results written back onto ``args``
    (``args.dtype`` a torch dtype, ``args.config``, ``args.link`` the ``SimulatedLink`` with
    ``args.link_text`` its text, ``args.checkpoint`` ``--save-checkpoint``'s directory where
    given). The benchmarks' commands use the value itself."""
    model = check_model(p, model_options(p, args), always_loads=always_loads)
    args.preset, args.dtype, args.config = model.preset, model.dtype, model.config
    args.checkpoint = model.checkpoint
    args.link_text, args.link = model.link, model.link_model


def default_checkpoint(args: argparse.Namespace, tag: str) -> None:
    """Without ``--checkpoint``: ``--preset`` written once with random weights to
    :func:`default_checkpoint_dir` and reused while it holds a ``config.json``
    (``args.checkpoint``, and ``args.save_checkpoint`` until then)."""
    if args.checkpoint:
        return
    args.checkpoint = default_checkpoint_dir(tag, args.preset, args.config.num_hidden_layers, args.dtype)
    if not (Path(args.checkpoint) / "config.json").is_file():
        args.save_checkpoint = args.checkpoint


def default_checkpoint_dir(tag: str, preset: str, layers: int, dtype: torch.dtype) -> str:
    """A directory under the system's temp dir named after ``tag``, the preset, its layers and
    dtype: where a run without ``--checkpoint`` keeps the preset it writes once."""
    name = str(dtype).removeprefix("torch.")
    return os.path.join(tempfile.gettempdir(), f"dbo-{tag}-{preset}-{layers}l-{name}")


def check_backends(p: argparse.ArgumentParser, names: list[str], args: Any) -> None:
    """``p.error`` for a backend of ``names`` that cannot run on ``args.device`` with ``args.dtype``
    (a torch dtype): ``args`` is a :class:`ModelOptions` or a namespace with those two."""
    for name in names:
        check_backend_fits(p, name, device=args.device, dtype=str(args.dtype).removeprefix("torch."))


def model_config(preset: str, layers: int | None) -> Any:
    """The config of ``preset`` (a :data:`PRESET_CHOICES` name) with ``layers`` decoder layers
    (None: the preset's; 2 for the tiny ones)."""
    if preset.startswith("tiny-"):
        return tiny_config(preset.removeprefix("tiny-"), layers=layers or 2)
    return preset_config(preset, layers=layers)
