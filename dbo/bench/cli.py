"""The benchmarks' command-line parts: the library's front door (:mod:`dbo.cli`: one-line errors
for bad input, plain help, the verdict line, re-exported here), the simulated-link options, and
the legend under a table."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from dbo.cli import (
    ArgumentParser,
    check_at_least,
    check_backend_fits,
    check_device,
    check_experts_split,
    check_memory_fits,
    check_writable_file,
    check_writable_folder,
    env_world_size,
    verdict,
)

__all__ = ["ArgumentParser", "env_world_size", "check_at_least", "check_device", "check_experts_split",
           "check_backend_fits", "verdict", "add_link_arguments", "parse_link", "check_writable_file",
           "check_writable_folder", "check_memory_fits", "legend"]


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


def legend(columns: Mapping[str, str]) -> list[str]:
    """The line under a table that says what each of its columns is (``columns``: heading ->
    meaning): ``  heading: meaning; heading: meaning``."""
    return ["  " + "; ".join(f"{name}: {meaning}" for name, meaning in columns.items())]
