"""``python -m dbo.bench overlap|switch|breakdown|experts|compare [ARGS]``; ``-h`` after a command
lists its options (``torchrun --nproc-per-node N -m dbo.bench overlap ...`` for the overlap one)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "overlap": "dbo.bench.overlap",
    "switch": "dbo.bench.switch",
    "breakdown": "dbo.bench.breakdown",
    "experts": "dbo.bench.experts",
    "compare": "dbo.bench.compare",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(__doc__.strip() + "\n" + f"commands: {', '.join(COMMANDS)}\n")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
