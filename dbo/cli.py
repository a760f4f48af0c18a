"""The front door of a command-line program built on dbo (the examples, the benchmarks): bad input
answered in one line, plain help, a verdict at the end.

A caller mistake (a bad option value, a missing file) ends a run with one line on stderr that
names the bad value and what is allowed, and exit code 2: no usage block, no traceback. Checks
that need the world size read torchrun's ``WORLD_SIZE`` before any process group exists, so
under torchrun every rank fails the same check, exits 2 and none waits for a peer; rank 0 says
why (:func:`refuse`). A run that completes ends with one line on stdout, ``PROG: PASS: why`` or
``PROG: FAIL: why`` (exit code 0 or 1). Ctrl-C ends a run that :func:`run_main` runs with one
line, ``PROG: interrupted (Ctrl-C)``, and exit code 130. ``-h`` prints docstrings as plain text
(no reStructuredText markup) and names a default only where it says something.

Under torchrun rank 0 speaks for the group (:func:`speaks_for_group`): its messages, tables,
progress bars and verdict are the run's; another rank prints only an error of its own
(:func:`quiet_other_ranks`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import NoReturn

import torch

from dbo.backends import BACKENDS, cpu_backends
from dbo.peers.deadline import end_process_within

__all__ = ["ArgumentParser", "plain_text", "env_world_size", "check_at_least", "check_device",
           "check_experts_split", "check_backend_fits", "check_writable_file", "check_writable_folder",
           "available_memory_bytes", "check_memory_fits", "verdict", "run_main", "speaks_for_group",
           "refuse", "quiet_other_ranks", "INTERRUPTED_EXIT_CODE", "INTERRUPT_GRACE_S",
           "REFUSAL_GRACE_S"]

#: the exit code of a run that Ctrl-C (SIGINT) ended, as a shell reports a process that SIGINT
#: killed (128 + 2)
INTERRUPTED_EXIT_CODE = 130

#: seconds a rank other than 0 that refuses its input waits for torchrun to stop it (rank 0 failed
#: the same check, said why and exited) before it says why itself (the check failed on it alone)
REFUSAL_GRACE_S = 10.0

#: seconds from an interrupted run's clean-up (its ``finally`` blocks, the process group's
#: teardown) to the end of the process, whatever still runs
INTERRUPT_GRACE_S = 30.0


def speaks_for_group() -> bool:
    """Whether this process speaks for the run: rank 0 under torchrun (its ``RANK``, readable
    before any process group exists), any process without torchrun. Tables, progress bars,
    messages and verdicts come from it alone; another rank prints only an error of its own."""
    return os.environ.get("RANK", "0") == "0"


def refuse(prog: str, message: str) -> NoReturn:
    """End the run for a caller mistake: ``PROG: message`` on stderr, one line, exit code 2.

    Under torchrun rank 0 says it. Another rank, which found the same mistake (the checks read
    the options and the environment, the same on every rank), waits up to :data:`REFUSAL_GRACE_S`
    for torchrun to stop it once rank 0 has exited; still running after that, the mistake was its
    own, and it says so itself (``PROG: rank N: message``).
    """
    if not speaks_for_group():
        time.sleep(REFUSAL_GRACE_S)
        message = f"rank {os.environ.get('RANK')}: {message}"
    sys.stderr.write(f"{prog}: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def quiet_other_ranks() -> None:
    """On a rank other than 0 (:func:`speaks_for_group`), leave the talking to rank 0: Python
    warnings ignored, the ``dbo`` and ``transformers`` loggers at ERROR, transformers' progress
    bars (its "Loading weights") off. An error of this rank's own (an ERROR line, a traceback, a
    refusal) still prints. :func:`run_main` calls it; a program of its own calls it before its
    work. Nothing changes on rank 0 or without torchrun."""
    if speaks_for_group():
        return
    warnings.simplefilter("ignore")
    for name in ("dbo", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:  # imported by the program (its bars are on by default)
        hf_logging.disable_progress_bar()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # for a transformers imported later


def plain_text(text: str) -> str:
    """``text`` (a docstring) without its markup: ``:class:`x``` and ``:mod:`~a.x``` become
    ``x`` / ``a.x``, double and single backticks are dropped, a trailing ``::`` (a literal block
    follows) becomes ``:``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "")
    text = re.sub(r"`([^`\n]+)`", r"\1", text)
    return re.sub(r"::(\s*)$", r":\1", text, flags=re.M)


class _PlainHelp(argparse.HelpFormatter):
    """Help without markup. Under :class:`argparse.ArgumentDefaultsHelpFormatter` it adds
    ``(default: X)`` only where X says something: not for None or an empty value, not for a flag
    (``store_true``, ``store_false``: the flag is the other value), not where the help already
    names a default."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not isinstance(self, argparse.ArgumentDefaultsHelpFormatter):
            return text
        empty = isinstance(action.default, (str, list, tuple)) and not action.default
        if (action.default in (None, argparse.SUPPRESS) or empty or action.nargs == 0
                or "default" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr and exit code 2, and whose
    help is plain text (see :func:`plain_text`; ``formatter_class`` is kept, markup removed).

    :meth:`error` is also how an entry point rejects a value it checks after parsing.
    """

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
                 **kwargs) -> None:
        plain = type(f"Plain{formatter_class.__name__}", (_PlainHelp, formatter_class), {})
        super().__init__(*args, formatter_class=plain, **kwargs)

    def error(self, message: str) -> NoReturn:
        refuse(self.prog, message)


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
    if spec.gpu_only and device != "cuda" and not (fake_deep_ep and spec.uses_deep_ep):
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


def check_writable_file(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """``parser.error`` unless ``path`` can be written as a file: not a folder, in a folder that
    exists and takes a new file (tried with a temporary file, removed at once: permission bits
    say nothing for root or for /proc). Call it before any work, and before the process group."""
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a folder, want a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: cannot write there: no folder {folder}")
    if not _takes_files(folder):
        parser.error(f"{option} {path}: cannot write there: {folder} is not writable")


def check_writable_folder(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """``parser.error`` unless ``path`` is a writable folder or one that can be made: not an
    existing file, and its nearest existing ancestor a folder that takes new entries (tried with a
    temporary folder, removed at once; nothing of ``path`` is created). Call it before any work."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        parser.error(f"{option} {path}: exists and is not a folder, want a folder")
    ancestor = full
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        parser.error(f"{option} {path}: cannot make it: {ancestor} is a file")
    if not _takes_files(ancestor):
        parser.error(f"{option} {path}: cannot write there: {ancestor} is not writable")


def available_memory_bytes(device: str) -> int | None:
    """The memory a run on ``device`` can still take, in bytes: on "cuda" the free memory of this
    rank's GPU (``LOCAL_RANK``, 0 without torchrun; ``torch.cuda.mem_get_info``), on "cpu" the
    available RAM (psutil where installed, else the free pages ``os.sysconf`` reports); None
    where it cannot be read."""
    try:
        if device == "cuda":
            if not torch.cuda.is_available():
                return None
            return int(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0])
        try:
            import psutil
        except ImportError:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(psutil.virtual_memory().available)
    except (OSError, ValueError, RuntimeError):
        return None


def check_memory_fits(parser: argparse.ArgumentParser, what: str, need_bytes: int, device: str) -> None:
    """``parser.error`` where ``need_bytes`` (a lower bound of what ``what``, an option and its
    value, needs on each rank) is more than :func:`available_memory_bytes` of ``device``: one line
    with both figures, before the model is built (an allocator traceback per rank otherwise)."""
    have = available_memory_bytes(device)
    if have is not None and need_bytes > have:
        parser.error(f"{what}: needs at least {_bytes(need_bytes)} a rank, and {device} has "
                     f"{_bytes(have)} available")


def _bytes(n: int) -> str:
    """``n`` bytes in the largest unit that keeps it >= 1 (``"102.4 GB"``)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _takes_files(folder: str) -> bool:
    """Whether a new folder can be made in ``folder`` (and removed again)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dbo-check-", dir=folder))
    except OSError:
        return False
    return True


def verdict(prog: str, ok: bool, why: str) -> int:
    """Print the run's last line, ``PROG: PASS: why`` or ``PROG: FAIL: why``; return the exit
    code (0 or 1)."""
    print(f"{prog}: {'PASS' if ok else 'FAIL'}: {why}", flush=True)
    return 0 if ok else 1


def run_main(prog: str, main: Callable[[], int | None]) -> int:
    """Run an entry point's ``main`` (its arguments bound) and return its exit code (None: 0),
    where Ctrl-C ends it with one line and exit code :data:`INTERRUPTED_EXIT_CODE`.

    The first SIGINT raises :class:`KeyboardInterrupt` where the run is, so that its ``finally``
    blocks and context managers clean up (the process group's teardown, temporary files and
    folders, a launched process stopped); later ones (torchrun's agent forwards the terminal's
    Ctrl-C to every rank, which has had it already; a second Ctrl-C) are ignored while they do.
    The run then ends with ``PROG: interrupted (Ctrl-C)`` on stderr from the process that speaks
    for the group (:func:`speaks_for_group`; the other ranks end silently), and the process
    ends within :data:`INTERRUPT_GRACE_S` whatever is still running. An exception raised after the
    SIGINT (a collective broken by a peer that left on its own Ctrl-C) is part of the
    interruption, not an error of its own. Outside the main thread, where no signal handler can
    be set, ``main`` runs as it is. Before ``main``: :func:`quiet_other_ranks`.
    """
    quiet_other_ranks()
    if threading.current_thread() is not threading.main_thread():
        return main() or 0
    interrupted = False

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return main() or 0
    except BaseException:
        if not interrupted:
            raise
        end_process_within(INTERRUPT_GRACE_S)
        if speaks_for_group():
            with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
                sys.stdout.flush()
                sys.stderr.write(f"{prog}: interrupted (Ctrl-C)\n")
                sys.stderr.flush()
        return INTERRUPTED_EXIT_CODE
    finally:
        if not interrupted:
            signal.signal(signal.SIGINT, previous)
