"""The options the transformers benchmarks (``hf-prefill``, ``hf-generate``) share, and the checks
that answer a bad value in one line before any process group exists.

Every check here runs on every rank with the same inputs (the arguments, torchrun's
``WORLD_SIZE``, the checkpoint's ``config.json``), so under torchrun either every rank passes or
every rank exits 2 with the same line (:class:`dbo.bench.cli.ArgumentParser`), and none waits for
a peer.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dbo.backends import backend_spec
from dbo.bench.cli import (
    add_link_arguments,
    check_at_least,
    check_backend_fits,
    check_device,
    check_writable_file,
    check_writable_folder,
    env_world_size,
    parse_link,
)
from dbo.integrations.transformers.presets import PRESETS, TINY_FAMILIES, preset_config, tiny_config

__all__ = ["DTYPES", "PRESET_CHOICES", "backend_name", "add_model_arguments", "check_model_arguments",
           "default_checkpoint",
           "check_backends", "num_routed_experts", "model_config"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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


def check_model_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, *,
                          always_loads: bool = False) -> None:
    """Fill the device-dependent defaults of :func:`add_model_arguments`'s options and check them
    (``p.error`` on the first bad one). Sets ``args.dtype`` (a torch dtype), ``args.config``
    (the model's config), ``args.link`` (a ``SimulatedLink`` or None; ``args.link_text`` keeps
    the option's text) and ``args.checkpoint`` (``--save-checkpoint``'s directory where given).
    A run that loads a checkpoint expert-parallel (``--checkpoint``, ``--save-checkpoint``, or
    every run where ``always_loads``) needs 2 or more ranks: at one rank transformers loads a
    model whole, and dbo's implementations would not run."""
    cuda = args.device == "cuda"
    if args.layers is not None:
        check_at_least(p, args, 1, "layers")
    check_device(p, args.device)
    if args.json:
        check_writable_file(p, "--json", args.json)
    args.preset = args.preset or ("qwen3-30b-a3b" if cuda else "tiny-qwen3_moe")
    args.dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    if args.remote_fraction is not None and not 0.0 < args.remote_fraction <= 1.0:
        p.error(f"--remote-fraction {args.remote_fraction}: want a share in (0, 1]")
    args.link_text, args.link = args.link, parse_link(p, args)
    if args.save_checkpoint and args.checkpoint and args.checkpoint != args.save_checkpoint:
        p.error(f"--checkpoint {args.checkpoint} and --save-checkpoint {args.save_checkpoint}: give one "
                "(--save-checkpoint writes the checkpoint it then loads)")
    if args.save_checkpoint:
        check_writable_folder(p, "--save-checkpoint", args.save_checkpoint)
        args.checkpoint = args.save_checkpoint
        args.config = model_config(args.preset, args.layers)
    elif args.checkpoint:
        args.config = _checkpoint_config(p, args.checkpoint)
    else:
        args.config = model_config(args.preset, args.layers)
    experts = num_routed_experts(args.config)
    if experts is None:
        p.error(f"{args.checkpoint or args.preset}: {type(args.config).__name__} names no routed "
                "experts; dbo runs Qwen3-MoE, Mixtral and DeepSeek-V3 models")
    world = env_world_size()
    if world < 2 and (always_loads or args.checkpoint):
        given = "--save-checkpoint" if args.save_checkpoint else "--checkpoint"
        what = "loading the checkpoint" if always_loads else f"{given} {args.checkpoint}: loading it"
        p.error(f"{what} expert-parallel needs 2 or more ranks (torchrun --nproc-per-node N ...); at one "
                "rank transformers loads a model whole")
    if experts % world:
        p.error(f"{args.checkpoint or args.preset}: its {experts} routed experts do not split evenly "
                f"over {world} ranks; run a number of ranks that divides {experts}")


def default_checkpoint(args: argparse.Namespace, tag: str) -> None:
    """Without ``--checkpoint``: ``--preset`` written once with random weights to a directory under
    the system's temp dir (named after ``tag``, the preset, its layers and dtype) and reused while
    it holds a ``config.json`` (``args.checkpoint``, and ``args.save_checkpoint`` until then)."""
    if args.checkpoint:
        return
    dtype = str(args.dtype).removeprefix("torch.")
    args.checkpoint = os.path.join(tempfile.gettempdir(),
                                   f"dbo-{tag}-{args.preset}-{args.config.num_hidden_layers}l-{dtype}")
    if not (Path(args.checkpoint) / "config.json").is_file():
        args.save_checkpoint = args.checkpoint


def check_backends(p: argparse.ArgumentParser, names: list[str], args: argparse.Namespace) -> None:
    """``p.error`` for a backend of ``names`` that cannot run on ``args.device`` with ``args.dtype``
    (a torch dtype)."""
    for name in names:
        check_backend_fits(p, name, device=args.device, dtype=str(args.dtype).removeprefix("torch."))


def model_config(preset: str, layers: int | None) -> Any:
    """The config of ``preset`` (a :data:`PRESET_CHOICES` name) with ``layers`` decoder layers
    (None: the preset's; 2 for the tiny ones)."""
    if preset.startswith("tiny-"):
        return tiny_config(preset.removeprefix("tiny-"), layers=layers or 2)
    return preset_config(preset, layers=layers)
