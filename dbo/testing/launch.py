"""Entry points run as ``python ARGV`` or ``torchrun --standalone --nproc-per-node N ARGV`` runs
them, in processes forked from a server that has already imported torch, transformers and dbo.

A fresh Python process spends about 3 s of CPU importing torch, transformers and dbo, and a
two-rank torchrun run pays that three times (its agent and each rank). A test of an entry point
wants the entry point's behaviour, not the imports: :func:`run_entry` starts each process as a
fork of multiprocessing's forkserver (the one :class:`dbo.testing.dist.DistWorld` uses, started
with :data:`FORKSERVER_PRELOAD` imported), so a run costs what its ``main`` costs.

``run_entry(argv, *, nproc=None, cwd=None, env=None, timeout=120.0, interrupt=None) -> EntryRun``
    ``argv`` is what follows ``python``: ``["-m", module, *args]``, ``["-c", code, *args]`` or
    ``[script, *args]``. ``nproc=None``: one process, as ``python ARGV``. ``nproc=N``: N ranks with
    the environment torchrun gives them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); this process serves
    their rendezvous store, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``), so no
    port is chosen ahead and left to collide. Once a rank ends with a code other than 0, the others
    get SIGTERM (SIGKILL 5 s later), as from torchrun's agent. Each process runs in ``cwd``
    (default: this one's) with exactly ``env`` (default: this one's) as its environment, its
    stdout and stderr collected (the ranks' interleaved, as under torchrun). Returns an
    :class:`EntryRun`; raises :class:`subprocess.TimeoutExpired` once every process (and
    whatever it started) is killed, if they had not all ended within ``timeout`` seconds.
    ``interrupt``: Ctrl-C in the middle of the run, SIGINT to every process and what it started,
    as a terminal sends it to its foreground processes, once the output holds ``interrupt`` (a
    string) or ``interrupt`` seconds (a number) after every process has started; under ``nproc``
    a second SIGINT follows, as torchrun's agent forwards the Ctrl-C it got, and the ranks are
    left to end by themselves (no SIGTERM on the first to end).

What differs from a process of its own: the modules of :data:`FORKSERVER_PRELOAD` were imported
once, under the server's environment (so a variable that torch reads at import, other than
``OMP_NUM_THREADS``, which is applied with ``torch.set_num_threads``, keeps the server's value);
what an entry point imports beyond them it imports itself. An entry point run this way that
starts processes of its own as :class:`ForkedProcess` (the fault runners' ``--fork-ranks``) forks
them from itself, without a second server. Tests of how torchrun itself reports a failure (its
per-rank summary) or of what is left of the process tree run torchrun.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.util
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["EntryRun", "ForkedProcess", "run_entry", "FORKSERVER_PRELOAD", "forkserver_context"]

#: what the forkserver imports before its first fork: torch, the library's modules that the entry
#: points import, and transformers with the model families the tests build (a module that cannot
#: be imported is left out; a module that is run as ``-m`` is never preloaded)
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "dbo", "dbo.testing.dist", "dbo.testing.launch",
    "dbo.bench.overlap.command", "dbo.bench.hf.prefill", "dbo.bench.hf.generate",
    "transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "dbo.integrations.transformers",
]

#: seconds between a rank's failure and SIGKILL to the ranks that ignored the SIGTERM
_TERM_GRACE_S = 5.0

#: True in a process that :func:`_start` runs: a fork of the server, which has imported what the
#: server had; the :class:`ForkedProcess` es it starts while it has one thread fork from it
#: directly, not from a new server (a new server is a new interpreter that imports it all again)
_forked_from_server = False


def forkserver_context():
    """multiprocessing's forkserver context, its server to import :data:`FORKSERVER_PRELOAD`
    (which takes effect where the server is not running yet: it starts once per process)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


@dataclass
class EntryRun:
    """One run: ``returncode`` is 0 when every process ended with 0, else the code of the first
    one seen to fail (a signal as ``-N``); ``returncodes`` has each rank's."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    returncodes: list[int] = field(default_factory=list)


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives a Python process (a message goes to stderr, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _run_as_main(argv: list[str]) -> int:
    """Run ``argv`` as ``python ARGV`` would, in this process; its exit status."""
    try:
        if argv[0] == "-m":
            module = argv[1]
            spec = importlib.util.find_spec(module)
            package = spec is not None and spec.submodule_search_locations is not None
            sys.modules.pop(f"{module}.__main__" if package else module, None)  # runs afresh
            sys.argv = [module, *argv[2:]]  # run_module puts the module's file first
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter reports it
        tb = exc.__traceback__  # from the entry's own frames on, as the interpreter prints it
        while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                                  or "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    return code


def _start(argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """The forked process: its own process group (setsid: a kill reaches what it starts),
    output to the shared files, the given directory and environment, then ``argv``; exits with
    its status."""
    global _forked_from_server
    _forked_from_server = True
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # the streams a Python process starts with when its output is not a terminal: stdout
    # block-buffered, stderr line-buffered (both unbuffered under PYTHONUNBUFFERED)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else
                                  io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False) if unbuffered else
                                  io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    if env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    code = _run_as_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _kill_group(proc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.killpg(proc.pid, sig)  # the process and what it started (its process group)
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(proc.pid, sig)


class ForkedProcess:
    """``python ARGV`` started as a fork of the forkserver, with the handful of
    :class:`subprocess.Popen`'s methods that waiting for a rank needs (``pid``, ``poll``, ``wait``,
    ``kill``, ``returncode``). Its stdout and stderr append to ``stdout_path`` and ``stderr_path``
    (which must exist; they may be one file). In a process that is itself such a fork (an entry
    point that :func:`run_entry` runs, starting its own ranks), it forks that process, which has
    imported what the server had, while that process has one thread."""

    def __init__(self, argv: list[str], *, stdout_path: str, stderr_path: str,
                 cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 name: str = "dbo-entry"):
        if not argv:
            raise ValueError("argv is empty: give what follows `python`")
        if argv[0] in ("-m", "-c") and len(argv) < 2:
            raise ValueError(f"argv {argv!r}: {argv[0]} needs its argument")
        self.args = list(argv)
        import multiprocessing as mp

        ctx = (mp.get_context("fork") if _forked_from_server and threading.active_count() == 1
               else forkserver_context())
        self._proc = ctx.Process(
            target=_start, name=name,
            args=(self.args, dict(os.environ if env is None else env),
                  os.fspath(cwd) if cwd is not None else os.getcwd(), stdout_path, stderr_path))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process and to what it started (its process group)."""
        if self.poll() is None:
            _kill_group(self, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _time_to_interrupt(when: str | float, started: float, out_path: str, err_path: str) -> bool:
    """Whether :func:`run_entry`'s ``interrupt`` is due: its text in the output so far, or its
    seconds since ``started``."""
    if not isinstance(when, str):
        return time.monotonic() - started >= when
    for path in (out_path, err_path):
        with open(path, errors="replace") as f:
            if when in f.read():
                return True
    return False


def run_entry(argv: list[str], *, nproc: int | None = None, cwd: str | os.PathLike | None = None,
              env: dict[str, str] | None = None, timeout: float = 120.0,
              interrupt: str | float | None = None) -> EntryRun:
    """Run ``argv`` as ``python ARGV`` (``nproc=None``) or as torchrun's ``nproc`` ranks; see the
    module doc."""
    if not argv:
        raise ValueError("argv is empty: give what follows `python`")
    if argv[0] in ("-m", "-c") and len(argv) < 2:
        raise ValueError(f"argv {argv!r}: {argv[0]} needs its argument")
    if nproc is not None and nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    base = dict(os.environ if env is None else env)
    store = None
    if nproc is not None:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0",
                    TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    ranks = 1 if nproc is None else nproc
    with tempfile.TemporaryDirectory(prefix="dbo-entry-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out_path, err_path):
            open(path, "w").close()  # noqa: SIM115 - created for the children to append to
        procs = []
        for rank in range(ranks):
            rank_env = dict(base)
            if nproc is not None:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc))
            procs.append(ForkedProcess(argv, stdout_path=out_path, stderr_path=err_path, cwd=cwd,
                                       env=rank_env, name=f"dbo-entry-{rank}"))
        codes: list[int | None] = [None] * ranks
        first_failed: int | None = None
        term_at: float | None = None
        started = time.monotonic()
        deadline = started + timeout
        interrupted = False
        try:
            while any(c is None for c in codes):
                if interrupt is not None and not interrupted and _time_to_interrupt(
                        interrupt, started, out_path, err_path):
                    interrupted = True
                    for _ in range(1 if nproc is None else 2):  # the terminal's, then the agent's
                        for q in procs:
                            q.send_signal(signal.SIGINT)
                        time.sleep(0.1)
                for i, p in enumerate(procs):
                    if codes[i] is None and p.poll() is not None:
                        codes[i] = p.returncode
                        if codes[i] != 0 and first_failed is None:
                            first_failed = codes[i]
                            term_at = None if interrupted else time.monotonic()
                            for q in procs if not interrupted else ():
                                q.terminate()  # as torchrun's agent: the others are stopped
                now = time.monotonic()
                if term_at is not None and now > term_at + _TERM_GRACE_S:
                    for q in procs:
                        q.kill()
                if now > deadline:
                    for q in procs:
                        q.kill()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            q.wait(timeout=5.0)
                    with open(out_path, errors="replace") as o, open(err_path, errors="replace") as e:
                        raise subprocess.TimeoutExpired(argv, timeout, o.read(), e.read())
                time.sleep(0.01)
        finally:
            for p in procs:
                p.kill()
            del store
        with open(out_path, errors="replace") as o, open(err_path, errors="replace") as e:
            stdout, stderr = o.read(), e.read()
    return EntryRun(list(argv), 0 if first_failed is None else first_failed, stdout, stderr,
                    [int(c) for c in codes])
