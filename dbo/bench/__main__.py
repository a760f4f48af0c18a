"""``python -m dbo.bench COMMAND [ARGS]``: :data:`COMMANDS` is the one list of the commands."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "overlap": "dbo.bench.overlap.command",
    "switch": "dbo.bench.switch",
    "breakdown": "dbo.bench.breakdown",
    "experts": "dbo.bench.experts.command",
    "compare": "dbo.bench.compare",
    "hf-prefill": "dbo.bench.hf.prefill",
    "hf-generate": "dbo.bench.hf.generate",
    "hf-load": "dbo.bench.hf.load",
}


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]``'s command with the rest; its exit code (2: no or an unknown command)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        sys.stderr.write(f"dbo.bench: unknown command {argv[0]!r} (commands: "
                         f"{', '.join(COMMANDS)})\n")
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        out = sys.stdout if argv else sys.stderr  # asked for (-h) or missing
        out.write(f"usage: python -m dbo.bench {{{','.join(COMMANDS)}}} [ARGS]; -h after a command "
                  "lists its options (torchrun --nproc-per-node N -m dbo.bench overlap ... for the "
                  "overlap one)\n")
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
