"""Shared test set-up: hypothesis profiles, the no-state-left-behind check, the worlds of
ranks a module's tests share, how many pytest-xdist workers ``-n auto`` (pyproject's
addopts) starts, and each worker's forkserver started before its first test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import dbo
from dbo.backends.deepep.buffer import BUFFER_CACHE
from dbo.peers.watchdog import WATCHDOG
from dbo.split import FALLBACK_LOG
from dbo.testing.dist import DistWorld
from dbo.ubatch.streams import current_logical_stream

#: the overlap benchmark's shared checks (tests/bench_overlap_checks.py), imported by two test
#: modules: pytest's assertion messages there too
pytest.register_assert_rewrite("bench_overlap_checks")

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: most workers for the whole suite: each imports torch and transformers and runs 2-rank jobs
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: a worker per core (at most MAX_WORKERS) for the whole suite or whole folders,
    whose time goes on multi-process jobs and the fault tests' timeouts, which overlap well (on
    2 cores, 3 and 4 workers took as long as 2); none (one process, no start-up cost) where
    files or tests are named, or where a GPU is visible (the GPU tests time kernels
    and share the GPUs). ``-n N`` and ``PYTEST_XDIST_AUTO_NUM_WORKERS`` (pytest-xdist's own,
    read by its default, which None leaves to) still decide."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return None
    here = config.invocation_params.dir
    if not all((here / Path(arg.split("::")[0])).is_dir() for arg in config.args):
        return 0
    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS) if cores > 1 else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files marked ``long_file`` first (each file's tests kept together, in order): the
    workers (``--dist loadfile``) take files in this order, so the longest start at once and the
    run does not end on one worker alone with one of them."""
    items.sort(key=lambda item: item.get_closest_marker("long_file") is None)


#: names in a test module that start processes from the forkserver
_FORKING_NAMES = ("run_entry", "ForkedProcess", "DistWorld", "forkserver_context")


def _forks(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return "worlds" in getattr(item, "fixturenames", ()) or any(
        hasattr(module, name) for name in _FORKING_NAMES)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where a collected test starts processes from the forkserver of dbo.testing.launch and
    DistWorld, the server is started, and waited for until it has forked once, before the first
    test: it imports torch and transformers (seconds of CPU, minutes on a loaded machine), which
    would otherwise count against the time limit of whichever test first starts a rank."""
    if not any(_forks(item) for item in session.items):
        return
    from dbo.testing.launch import forkserver_context

    first = forkserver_context().Process(target=os.getpid)
    first.start()
    first.join()


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """Every test must leave no active run on the thread and the default CPU stream current."""
    stream_before = current_logical_stream()
    yield
    assert dbo.active_run() is None, "a run_ubatches run was left active on this thread"
    assert not dbo.dbo_enabled()
    assert current_logical_stream() is stream_before, "the CPU stand-in's current stream leaked"
    assert len(BUFFER_CACHE) == 0, "a test left DeepEP buffers in the process-wide cache"
    assert len(WATCHDOG) == 0, "a test left GPU waits with the process-wide watchdog"
    FALLBACK_LOG.reset()  # each test sees each fallback reason logged afresh


@pytest.fixture(scope="module")
def worlds():
    """``worlds(n, **options)``: a started ``DistWorld(n, **options)``, one per size and options
    for the module's tests to share, closed after its last test (killed where
    ``kill_on_close=True``: a fault test may leave a rank that would not answer a polite stop)."""
    made: dict[tuple, tuple[DistWorld, bool]] = {}

    def get(n: int, *, kill_on_close: bool = False, **options) -> DistWorld:
        key = (n, tuple(sorted(options.items())))
        if key not in made:
            world = DistWorld(n, **options)
            world.start()
            made[key] = world, kill_on_close
        return made[key][0]

    yield get
    for world, kill in made.values():
        world.close(kill=kill)


def _world_options(request: pytest.FixtureRequest) -> dict:
    marker = request.node.get_closest_marker("dist_world")
    return dict(marker.kwargs) if marker else {}


@pytest.fixture(scope="module")
def world2(worlds, request):
    """The module's 2-rank world; a module passes options to it (``DistWorld``'s and
    ``kill_on_close``) as ``pytestmark = pytest.mark.dist_world(pg_timeout_s=60.0)``."""
    return worlds(2, **_world_options(request))


@pytest.fixture(scope="module")
def world3(worlds, request):
    """The module's 3-rank world, with the options of its ``dist_world`` mark."""
    return worlds(3, **_world_options(request))


@pytest.fixture(scope="session")
def tiny_qwen3_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (``tiny_random_model("qwen3_moe", 0)``), written once
    for the tests that load it expert-parallel."""
    from dbo.integrations.transformers.presets import tiny_random_model

    path = tmp_path_factory.mktemp("ckpt") / "qwen3_moe"
    tiny_random_model("qwen3_moe", 0).save_pretrained(path)
    return str(path)
