"""A reusable world of N torch.distributed processes that runs many test jobs.

Spawning processes and importing torch costs seconds, so a test module starts one world per
world size and sends it many jobs. API:

``DistWorld(world_size, *, backend="gloo", pg_timeout_s=30.0, start_timeout_s=60.0,
env=None)``
    Starts ``world_size`` processes (``OMP_NUM_THREADS=1``, one torch thread each) that join one
    process group (``file://`` rendezvous, no ports to collide on) and wait for jobs. Use as a
    context manager or call :meth:`close`. ``start_method="forkserver"`` (default): a server
    process imports torch once (about 2 s) and every worker of every later world is a cheap
    fork of it (about 0.05 s per world); ``"spawn"`` imports torch in every worker.

``world.run(fn, *args, timeout_s=60.0, **kwargs) -> list``
    Runs ``fn(*args, **kwargs)`` on every rank at once and returns the results in rank order.
    ``fn`` must be picklable by reference (a module-level function of an importable module;
    test modules are fine: the children get the parent's ``sys.path``); arguments and results
    must be picklable. Inside ``fn``, ``torch.distributed`` is initialized:
    ``dist.get_rank()`` tells the rank (under ``backend="nccl"`` rank ``r`` has GPU
    ``r % device_count`` as its current device). If any rank raised, :class:`DistJobError` is raised
    after all ranks answered, with every failing rank's traceback in its message. If not all
    ranks answer within ``timeout_s`` (a hang), or a process dies, the world is torn down
    (killed) and :class:`DistTimeoutError` / :class:`DistJobError` is raised; the next ``run``
    starts a fresh world (``restart_on_failure=True``, the default), so one failing test does
    not poison the module.

``world.run_outcomes(fn, *args, timeout_s=60.0, **kwargs) -> list[RankOutcome]``
    Same, but never raises for a rank's failure: returns a :class:`RankOutcome` per rank
    (``ok``, ``value``, ``error_type``, ``error``, ``traceback``, ``exitcode``, ``elapsed_s``).
    For fault-injection tests (a rank that raises or exits mid-step).

``world.restart()``
    Kill and respawn the workers. Call it after a job that left the process group out of step
    (a rank that raised between collectives leaves the others' pending work behind).

Pytest use (one world per module)::

    @pytest.fixture(scope="module")
    def world2():
        with DistWorld(2) as w:
            yield w

    def _case(n):            # module level, so it pickles by reference
        import torch.distributed as dist
        return dist.get_rank() * n

    def test_case(world2):
        assert world2.run(_case, 3) == [0, 3]

Not thread-safe: one job at a time per world.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["DistWorld", "DistJobError", "DistTimeoutError", "RankOutcome", "port_file_store"]

logger = logging.getLogger(__name__)


class DistJobError(RuntimeError):
    """A job raised on one or more ranks (or a worker process died)."""

    def __init__(self, message: str, outcomes: list[RankOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


class DistTimeoutError(TimeoutError):
    """Not every rank answered within the job's timeout; the world was torn down."""


@dataclass
class RankOutcome:
    """What one rank's job did."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    exitcode: int | None = None
    elapsed_s: float = 0.0


def port_file_store(path: str, rank: int, world_size: int, wait_s: float = 120.0) -> Any:
    """A TCPStore for a group whose ranks share a file system: rank 0 serves it on a port the
    system picks and writes the port to ``path``; the others read it there (within ``wait_s``).
    No port is chosen beforehand, so groups started side by side cannot collide on one."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)
        return store
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not start the group's store within {wait_s:.0f} s")
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False)


def _worker(rank: int, world_size: int, backend: str, init_file: str, pg_timeout_s: float,
            env: dict[str, str], jobs: Any, results: Any) -> None:
    import datetime

    os.environ.update(env)
    if backend == "nccl":  # as torchrun sets them: transformers places a rank's shard on LOCAL_RANK's GPU
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    logging.basicConfig(level=os.environ.get("DBO_TEST_LOG_LEVEL", "WARNING"))
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if backend == "nccl":  # a TCPStore, as under torchrun (what NCCL and symmetric memory ran on)
        dist.init_process_group(backend, store=port_file_store(init_file, rank, world_size),
                                rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timeout)
    results.put(("ready", rank, None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        t0 = time.monotonic()
        try:
            value = fn(*args, **kwargs)
            out = RankOutcome(rank, True, value, elapsed_s=time.monotonic() - t0)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = RankOutcome(rank, False, None, type(exc).__name__, str(exc),
                              traceback.format_exc(), elapsed_s=time.monotonic() - t0)
        try:
            results.put((job_id, rank, out))
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            results.put((job_id, rank, RankOutcome(rank, False, None, type(exc).__name__,
                                                   f"result not picklable: {exc}",
                                                   traceback.format_exc())))
    job = fn = args = kwargs = value = out = None  # noqa: F841 - drop the last job's objects
    gc.collect()  # backends and their pending work die before the group (dbo.peers.process_group)
    with contextlib.suppress(Exception):  # the group may be broken after a fault test
        dist.destroy_process_group()


class DistWorld:
    """N processes in one process group, running jobs sent by :meth:`run`. See module doc."""

    def __init__(self, world_size: int, *, backend: str = "gloo", pg_timeout_s: float = 30.0,
                 start_timeout_s: float = 60.0, env: dict[str, str] | None = None,
                 restart_on_failure: bool = True, start_method: str = "forkserver"):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
        self.restart_on_failure = restart_on_failure
        self.start_method = start_method
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None
        self._job_id = 0
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self.starts = 0

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Spawn the processes and wait until all joined the process group."""
        import torch.multiprocessing as mp

        if self._procs:
            raise RuntimeError("DistWorld already started")
        if self.start_method == "forkserver":
            # the server imports torch once; each worker is a cheap fork of it
            from dbo.testing.launch import forkserver_context

            ctx = forkserver_context()
        else:
            ctx = mp.get_context(self.start_method)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="dbo-dist-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)  # children read these at torch import
        try:
            for r in range(self.world_size):
                p = ctx.Process(target=_worker, name=f"dbo-dist-rank{r}", daemon=True,
                                args=(r, self.world_size, self.backend, init_file,
                                      self.pg_timeout_s, self.env, self._jobs[r], self._results))
                p.start()
                self._procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.starts += 1
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.world_size:
            try:
                tag, rank, _ = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    raise DistJobError(f"DistWorld({self.world_size}) failed to start: ranks "
                                       f"{dead or 'all'} did not come up", []) from None
                continue
            if tag == "ready":
                ready.add(rank)
        logger.info("DistWorld(%d, %s) started", self.world_size, self.backend)

    def close(self, *, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``) and forget them."""
        procs, self._procs = self._procs, []
        if not kill:
            for q in self._jobs:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - queue already broken
                    kill = True
            for p in procs:
                p.join(timeout=5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in [*self._jobs, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._jobs, self._results = [], None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def restart(self) -> None:
        """Kill the workers and start fresh ones (after a fault test left the group broken)."""
        self.close(kill=True)
        self.start()

    def __enter__(self) -> DistWorld:
        if not self._procs:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- jobs ---------------------------------------------------------------------------

    def run_outcomes(self, fn: Any, *args: Any, timeout_s: float = 60.0,
                     **kwargs: Any) -> list[RankOutcome]:
        """Run ``fn`` on every rank; one :class:`RankOutcome` per rank (see module doc).

        Raises :class:`DistTimeoutError` if a live rank did not answer in ``timeout_s``.
        """
        if not self.alive:
            if self._procs and not self.restart_on_failure:
                raise DistJobError("the DistWorld is broken (a worker died)", [])
            if self._procs:
                logger.warning("DistWorld(%d): restarting a broken world", self.world_size)
                self.close(kill=True)
            self.start()
        self._job_id += 1
        job_id = self._job_id
        for q in self._jobs:
            q.put((job_id, fn, args, kwargs))
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            try:
                jid, rank, out = self._results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in outcomes and not p.is_alive():
                        outcomes[r] = RankOutcome(r, False, None, "ProcessExit",
                                                  f"rank {r} exited with code {p.exitcode}",
                                                  exitcode=p.exitcode)
                if time.monotonic() > deadline and len(outcomes) < self.world_size:
                    missing = sorted(set(range(self.world_size)) - set(outcomes))
                    self.close(kill=True)
                    raise DistTimeoutError(
                        f"{getattr(fn, '__name__', fn)}: ranks {missing} did not finish within "
                        f"{timeout_s:.0f} s (hang?); the world was torn down") from None
                continue
            if jid == job_id and rank not in outcomes:
                outcomes[rank] = out
        if any(o.exitcode is not None for o in outcomes.values()):
            self.close(kill=True)  # the group lost a member: the next run starts afresh
        return [outcomes[r] for r in range(self.world_size)]

    def run(self, fn: Any, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order (see module doc)."""
        outcomes = self.run_outcomes(fn, *args, timeout_s=timeout_s, **kwargs)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            name = getattr(fn, "__name__", repr(fn))
            detail = "\n".join(f"--- rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}"
                               for o in failed)
            raise DistJobError(f"{name} failed on ranks {[o.rank for o in failed]}:\n{detail}",
                               outcomes)
        return [o.value for o in outcomes]
