"""The rank processes of one fault case: a fault leaves its group out of step, so the GPU fault
runners (``tests/gpu/run_deepep_faults.py``, ``tests/gpu/run_hf_faults.py``) start a fresh set
per case (:func:`spawn_ranks`), note when each ends (:func:`poll_ranks`) and read back each
one's result, exit status, exit time and stderr (:func:`collect_ranks`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["free_port", "spawn_ranks", "poll_ranks", "collect_ranks"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (a case's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(argv: Callable[[int, dict[str, str]], list[str]], tmp: str, tag: str, *,
                world_size: int = 2, fork: bool = False) -> list[dict]:
    """Start one process per rank of a fault case: ``argv(rank, files)`` is its command line,
    ``files["result"]`` the path of the JSON it writes, ``files["err"]`` where its stdout and
    stderr go (both under ``tmp``, named after ``tag``). ``fork``: a command line of this
    interpreter (``sys.executable ...``) runs as a fork of a server that has imported torch
    (:class:`dbo.testing.launch.ForkedProcess`: about 3 s less CPU a rank), not a new
    interpreter. Returns a record per rank for :func:`collect_ranks` (``rank``, ``p``: the
    ``Popen`` or ``ForkedProcess``)."""
    procs = []
    for rank in range(world_size):
        files = {k: os.path.join(tmp, f"{tag}.{rank}.{k}") for k in ("result", "err")}
        err = open(files["err"], "w")  # noqa: SIM115 - closed in collect_ranks
        cmd = argv(rank, files)
        if fork and cmd[0] == sys.executable:
            from dbo.testing.launch import ForkedProcess

            p = ForkedProcess(cmd[1:], stdout_path=files["err"], stderr_path=files["err"],
                              name=f"{tag}.{rank}")
        else:
            p = subprocess.Popen(cmd, stdout=err, stderr=err)
        procs.append({"rank": rank, "p": p, "files": files, "errf": err, "exit_time": None})
    return procs


def poll_ranks(procs: list[dict]) -> bool:
    """Note the exit time (wall clock) of each process of :func:`spawn_ranks` that ended since
    the last call; whether all have. Call it often (every few tens of ms) while they run: the
    exit times are only as exact as the polling."""
    for p in procs:
        if p["exit_time"] is None and p["p"].poll() is not None:
            p["exit_time"] = time.time()
    return all(p["exit_time"] is not None for p in procs)


def collect_ranks(procs: list[dict], deadline: float) -> None:
    """Wait for the processes of :func:`spawn_ranks`, killing those still running at
    ``deadline`` (wall clock; their record gets ``killed``). Adds to each record ``exit_time``
    (wall clock, polled every 20 ms here and by :func:`poll_ranks`), ``code`` (exit status;
    negative: the signal), ``result`` (its JSON, None if it wrote none), ``stderr`` (the last
    3000 characters) and ``deadline`` (from the whole log: the ``Timeout (h:mm:ss)!`` line of a
    :func:`dbo.peers.watchdog.gil_free_deadline` end and the stack line naming the wait,
    ``File "[dbo watchdog] ..."``, each "" where absent)."""
    while not poll_ranks(procs):
        if time.time() > deadline:
            for p in procs:
                if p["exit_time"] is None:
                    p["p"].kill()
                    p["p"].wait()
                    p["exit_time"] = time.time()
                    p["killed"] = True
        time.sleep(0.02)
    for p in procs:
        p["errf"].close()
        p["code"] = p["p"].returncode
        try:
            with open(p["files"]["result"]) as f:
                p["result"] = json.load(f)
        except (OSError, ValueError):
            p["result"] = None
        with open(p["files"]["err"], errors="replace") as f:
            text = f.read()
        p["stderr"] = text[-3000:]
        lines = text.splitlines()
        p["deadline"] = (next((ln for ln in lines if ln.startswith("Timeout (")), ""),
                         next((ln.strip() for ln in lines if '"[dbo watchdog] ' in ln), ""))
