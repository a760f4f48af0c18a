"""The benchmarks' and examples' front door: bad input answered in one line, a verdict at the end.

A caller mistake (a bad option value, a missing file) ends a run with one line on stderr that
names the bad value and what is allowed, and exit code 2: no usage block, no traceback. Checks
that need the world size read torchrun's ``WORLD_SIZE`` before any process group exists, so
under torchrun every rank fails the same check, exits 2 and none waits for a peer. A run that
completes ends with one line on stdout, ``PROG: PASS: why`` or ``PROG: FAIL: why`` (exit code 0
or 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

import torch

from dbo.backends import BACKENDS, cpu_backends

__all__ = ["ArgumentParser", "env_world_size", "check_at_least", "check_device", "check_experts_split",
           "check_backend_fits", "verdict", "add_link_arguments", "parse_link"]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr and exit code 2.

    :meth:`error` is also how an entry point rejects a value it checks after parsing.
    """

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message}\n")
        raise SystemExit(2)


def env_world_size() -> int:
    """The world size torchrun announces (``WORLD_SIZE``), 1 without torchrun; readable before
    the process group exists."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer >= 1, got {raw!r}") from None
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be an integer >= 1, got {raw!r}")
    return world


def check_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, low: int,
                   *names: str) -> None:
    """``parser.error`` naming the first option of ``names`` (attribute names of ``args``) whose
    value is below ``low``; a list value (``nargs``) is checked item by item."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v < low:
                parser.error(f"--{name.replace('_', '-')} {v}: must be >= {low}")


def check_device(parser: argparse.ArgumentParser, device: str | None) -> None:
    """``parser.error`` where ``device`` is "cuda" and this machine has no CUDA device. Call it
    before any process group: without it every rank would fail in its CUDA set-up with a
    traceback of its own."""
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: needs CUDA, and this machine has no CUDA device; use --device cpu")


def check_backend_fits(parser: argparse.ArgumentParser, backend: str, *, device: str,
                       dtype: str | None = None, fake_deep_ep: bool = False) -> None:
    """``parser.error`` unless backend ``backend`` runs on ``device`` ("cpu" or "cuda") with
    activations of ``dtype`` (a ``torch`` dtype name; None: not checked). ``fake_deep_ep``:
    DeepEP's backends run on the CPU on dbo.testing's fake."""
    spec = BACKENDS[backend]
    if spec.gpu_only and device != "cuda" and not (fake_deep_ep and backend.startswith("deepep")):
        parser.error(f"--backend {backend} needs --device cuda (on {device}: "
                     f"{', '.join(cpu_backends())})")
    if spec.bf16_only and dtype not in (None, "bfloat16"):
        parser.error(f"--backend {backend} moves bfloat16 only, not --dtype {dtype} "
                     "(add --dtype bfloat16)")


def check_experts_split(parser: argparse.ArgumentParser, experts: int, world: int,
                        option: str = "--experts") -> None:
    """``parser.error`` unless ``experts`` routed experts split evenly over ``world`` ranks."""
    if experts % world:
        fit = max(world, experts // world * world)
        parser.error(f"{option} {experts} is not a multiple of the world size {world} "
                     f"(each rank holds experts/world of them; e.g. {option} {fit})")


def verdict(prog: str, ok: bool, why: str) -> int:
    """Print the run's last line, ``PROG: PASS: why`` or ``PROG: FAIL: why``; return the exit
    code (0 or 1)."""
    print(f"{prog}: {'PASS' if ok else 'FAIL'}: {why}", flush=True)
    return 0 if ok else 1


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """``--link``, ``--link-order`` and ``--remote-fraction``: a benchmark's backends under a
    simulated link (:mod:`dbo.backends.simulated_link`); read them with :func:`parse_link`."""
    p.add_argument("--link", default=None, metavar="PRESET|GBPS[,FIXED_US[,COMBINE_FIXED_US]]",
                   help="hold every dispatch and combine back to a simulated link: a preset fitted to "
                        "DeepEP's internode figures (deepep-ib: decode, deepep-ib-ht: prefill) or GBPS "
                        "GB/s per GPU with a fixed cost per call (dbo.backends.simulated_link); the "
                        "bytes still move")
    p.add_argument("--link-order", choices=["nic", "host"], default="nic",
                   help="with --link: nic serves each transfer when its data is ready, sharing the rate "
                        "with those in flight; host queues them in the host's order at the full rate "
                        "(how the link was modelled before)")
    p.add_argument("--remote-fraction", type=float, default=None,
                   help="with --link: the share of the traffic that crosses the link (7/8 = 0.875 for "
                        "8 GPUs a host; default 1; an emulated rank counts it from the hosts)")


def parse_link(p: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The ``SimulatedLink`` of :func:`add_link_arguments`' options, None without ``--link``; a bad
    value ends in ``p.error``."""
    if args.link is None:
        return None
    from dbo.backends.simulated_link import SimulatedLink

    try:
        # an emulated rank counts its remote bytes itself (its option is --remote-fraction too)
        emulated = getattr(args, "emulate_ep", None)
        share = 1.0 if args.remote_fraction is None or emulated else args.remote_fraction
        return SimulatedLink.parse(args.link, share, getattr(args, "link_order", "nic"))
    except ValueError as exc:
        p.error(f"--link {args.link}: {exc}")
