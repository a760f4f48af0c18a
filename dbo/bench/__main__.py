"""``python -m dbo.bench COMMAND [ARGS]``: :data:`COMMANDS` is the one list of the commands."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from dbo.cli import run_main


@dataclass(frozen=True)
class Command:
    """A command's module (its ``main(argv)`` runs it) and the line ``--help`` shows for it."""

    module: str
    summary: str


COMMANDS = {
    "overlap": Command("dbo.bench.overlap.command",
                       "how much of the all-to-all DBO hides, per MoE layer (under torchrun)"),
    "switch": Command("dbo.bench.switch",
                      "the CPU cost of one ubatch switch, against a thread hand-off"),
    "breakdown": Command("dbo.bench.breakdown",
                         "where a DBO step's time goes, from a serial and a DBO profiler trace"),
    "experts": Command("dbo.bench.experts.command",
                       "the routed experts alone, against the hardware limit (GPU)"),
    "compare": Command("dbo.bench.compare",
                       "the speedup of the best DBO step over the best serial one of any backend, "
                       "from overlap bundles"),
    "hf-prefill": Command("dbo.bench.hf.prefill",
                          "a transformers MoE model's prefill, plain against DBO, per backend "
                          "(under torchrun)"),
    "hf-generate": Command("dbo.bench.hf.generate",
                           "greedy decoding of a transformers MoE model: generate() against dbo's "
                           "greedy_generate (under torchrun)"),
    "hf-load": Command("dbo.bench.hf.load",
                       "loading a real-sized checkpoint expert-parallel on CPU: peak memory and "
                       "time per rank"),
}


def usage() -> str:
    """What ``python -m dbo.bench --help`` prints: the usage line and a line per command."""
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m dbo.bench COMMAND [ARGS]   (torchrun --nproc-per-node N -m dbo.bench "
             "COMMAND ... for the ones under torchrun)", "", "commands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "python -m dbo.bench COMMAND -h lists the command's options."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]``'s command with the rest; its exit code (2: no or an unknown command)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        sys.stderr.write(f"dbo.bench: unknown command {argv[0]!r} (commands: "
                         f"{', '.join(COMMANDS)})\n")
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(usage())  # asked for (-h), or no command given
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]].module)
    # Ctrl-C: one line, exit code 130 (the command's name as its verdict line gives it)
    return run_main(getattr(module, "PROG", f"python -m dbo.bench {argv[0]}"),
                    lambda: module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
