"""The peer-timeout machinery on its own: the timeout scope, the arrival board and the GPU-wait
watchdog (with stand-in events, and the real process exit in a subprocess)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dbo import run_ubatches
from dbo.errors import CollectiveTimeoutError
from dbo.overlap import DBOWrapper, overlapped_forward
from dbo.peers.arrival import ArrivalBoard, process_state
from dbo.peers.watchdog import (
    GPU_WAIT_TIMEOUT_EXIT_CODE,
    GpuWaitWatchdog,
    WaitSite,
    collective_timeout,
    raise_peer_timeout,
    resolve_timeout,
    timeout_message,
)
from dbo.split import SplitConfig
from dbo.testing.launch import EntryRun, run_entry


class _Event:
    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


SITE = WaitSite("deepep_ll", "dispatch receive", 1, 0)


# ---- the timeout scope -----------------------------------------------------------------------


def test_scope_overrides_the_backend_default_and_nests():
    assert resolve_timeout(60.0) == 60.0
    with collective_timeout(5):
        assert resolve_timeout(60.0) == 5.0
        with collective_timeout(None):  # None leaves the one in force
            assert resolve_timeout(60.0) == 5.0
        with collective_timeout(0.5):
            assert resolve_timeout(60.0) == 0.5
        assert resolve_timeout(60.0) == 5.0
    assert resolve_timeout(60.0) == 60.0
    for bad in (0, -1, True, "3"):
        with pytest.raises(ValueError), collective_timeout(bad):
            pass


def test_scope_reaches_every_ubatch():
    with collective_timeout(2.5):
        seen = run_ubatches([lambda: resolve_timeout(60.0), lambda: resolve_timeout(60.0)], device="cpu")
    assert seen == [2.5, 2.5]


def _cfg() -> SplitConfig:
    return SplitConfig(decode_token_threshold=4, prefill_token_threshold=4, adaptive=False)


@pytest.mark.parametrize("rows", [2, 8])  # below the threshold (plain call) and split
def test_overlapped_forward_and_wrapper_pass_timeout_s(rows):
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + resolve_timeout(60.0)

    x = torch.zeros(rows, 3)
    out = overlapped_forward(fn, x, config=_cfg(), decode_only=True, agree=False, timeout_s=1.25)
    assert torch.equal(out, torch.full((rows, 3), 1.25))
    wrapped = DBOWrapper(fn, _cfg(), agree=False, timeout_s=0.75)
    assert torch.equal(wrapped(x, decode_only=True), torch.full((rows, 3), 0.75))
    assert torch.equal(overlapped_forward(fn, x, config=_cfg(), decode_only=True, agree=False),
                       torch.full((rows, 3), 60.0))
    with pytest.raises(ValueError, match="timeout_s"):
        DBOWrapper(fn, timeout_s=0)


# ---- the error and its message -----------------------------------------------------------------


def test_timeout_error_names_backend_phase_ubatch_and_ranks():
    with pytest.raises(CollectiveTimeoutError) as info:
        raise_peer_timeout(WaitSite("deepep_ht", "combine", 1, 2), 3.0, [0, 3], "rank 0: process exited")
    err = info.value
    assert str(err) == ("deepep_ht combine of ubatch 1 on rank 2: ranks 0, 3 did not arrive within "
                        "3.0 s; rank 0: process exited")
    assert (err.backend, err.phase, err.ubatch, err.missing_ranks) == ("deepep_ht", "combine", 1, (0, 3))
    assert isinstance(err, TimeoutError)
    back = pickle.loads(pickle.dumps(err))  # crosses process boundaries with its fields
    assert str(back) == str(err) and back.missing_ranks == (0, 3)
    gpu = timeout_message(SITE, 2.0, [1], where="gpu")
    assert "rank 1 did not arrive within 2.0 s" in gpu and f"exit code {GPU_WAIT_TIMEOUT_EXIT_CODE}" in gpu


# ---- the arrival board -------------------------------------------------------------------------


def test_board_counts_and_describes():
    board = ArrivalBoard.local(0, 2)
    try:
        assert board.arrive() == 1 and board.missing(1) == []
        assert board.wait(1, 0.01) == []
        assert board.remote_ranks == [1]
        missing, detail = board.behind(1)
        assert missing == [1] and "other hosts" in detail
        board.abandon()
        assert board.seq == 1
    finally:
        board.close()


def test_process_state():
    assert process_state(subprocess.os.getpid()) == "running"
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert process_state(p.pid) == "exited"


# ---- the GPU-wait watchdog ---------------------------------------------------------------------


def test_watchdog_retires_done_events_and_expires_the_late_one():
    fired: list[str] = []
    wd = GpuWaitWatchdog(on_expire=fired.append)
    done, late = _Event(done=True), _Event()
    wd.watch(done, 1.0, SITE)
    wd.watch(late, 1.0, SITE, lambda: ([1], "rank 1: process exited, reached launch 4 of 5"))
    wd.stop()  # drive it by hand
    now = time.monotonic()
    wd.poll(now)
    assert len(wd) == 1 and not fired  # the done one is gone; the late one is not late yet
    wd.poll(now + 1.5)
    assert len(wd) == 0 and len(fired) == 1
    assert fired[0].startswith("deepep_ll dispatch receive of ubatch 1 on rank 0: rank 1 did not "
                               "arrive within 1.0 s; rank 1: process exited")
    late.done = True
    wd.watch(_Event(), 1.0, SITE)
    wd.stop()
    wd.reset()
    wd.poll(now + 10)
    assert len(fired) == 1  # reset dropped it


class _LostContextEvent:
    def query(self):
        raise RuntimeError("CUDA error: unspecified launch failure")


def test_watchdog_drops_an_event_whose_query_fails_and_fires_for_no_one():
    """A trapped kernel leaves the CUDA context lost: every query raises. The watchdog drops
    such events (the caller's next CUDA call raises the error) instead of failing every poll."""
    fired: list[str] = []
    wd = GpuWaitWatchdog(on_expire=fired.append)
    wd.watch(_LostContextEvent(), 1.0, SITE)
    wd.watch(_Event(done=True), 1.0, SITE)
    wd.stop()
    wd.poll(time.monotonic() + 5)
    assert len(wd) == 0 and not fired


def test_watchdog_thread_fires_within_the_timeout():
    fired: list[str] = []
    wd = GpuWaitWatchdog(poll_s=0.02, on_expire=fired.append)
    t0 = time.monotonic()
    wd.watch(_Event(), 0.3, SITE)
    while not fired and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    wd.stop()
    # never before the timeout; after it within 10x (a loaded machine delays the poll thread)
    assert fired and 0.3 <= time.monotonic() - t0 < 10 * 0.3


def test_watchdog_ends_the_process_with_the_message():
    code = textwrap.dedent("""
        import time
        from dbo.peers.watchdog import WATCHDOG, WaitSite
        class Never:
            def query(self):
                return False
        WATCHDOG.watch(Never(), 0.5, WaitSite("deepep_ht", "combine", 0, 1), lambda: ([0], "rank 0: gone"))
        time.sleep(600)
        print("not reached")
    """)
    t0 = time.monotonic()
    p = run_entry(["-c", code], timeout=60)  # forked from a process that has imported torch
    elapsed = time.monotonic() - t0
    assert p.returncode == GPU_WAIT_TIMEOUT_EXIT_CODE, (p.returncode, p.stderr)
    assert "not reached" not in p.stdout
    assert ("deepep_ht combine of ubatch 0 on rank 1: rank 0 did not arrive within 0.5 s; rank 0: "
            "gone") in p.stderr, p.stderr
    assert elapsed < 30  # about 1 s: the fork, the 0.5 s timeout


def test_teardown_deadline_ends_a_stuck_teardown_and_not_a_quick_one():

    from dbo.peers.watchdog import GPU_WAIT_TIMEOUT_EXIT_CODE, teardown_deadline

    with pytest.raises(ValueError, match="positive"), teardown_deadline(0):
        pass
    with teardown_deadline(5.0):  # finishes first: the timer is cancelled
        pass
    code = ("import time\nfrom dbo.peers.watchdog import teardown_deadline\n"
            "with teardown_deadline(0.3, 'freeing the buffers'):\n    time.sleep(30)\n")
    proc = run_entry(["-c", code], timeout=60)
    assert proc.returncode == GPU_WAIT_TIMEOUT_EXIT_CODE, proc
    assert "freeing the buffers did not finish" in proc.stderr, proc.stderr
    assert "line 4 in <module>" in proc.stderr, proc.stderr  # the stuck call's stack


# a C call that holds the GIL for minutes: the regex engine on a catastrophic pattern
_HOLDS_THE_GIL = "import re\nre.match(r'(a+)+$', 'a' * 60 + 'b')\n"


def _run(code: str) -> tuple[EntryRun, float]:
    """``python -c CODE``, forked from a process that has imported torch (dbo.testing.launch)."""
    t0 = time.monotonic()
    proc = run_entry(["-c", code], timeout=120)
    return proc, time.monotonic() - t0


def _run_to_the_deadline(code: str, stamp: str = "Timeout") -> EntryRun:
    """``_run(code)``, which a deadline must end: exit 1, ``stamp`` (faulthandler's
    ``Timeout (h:mm:ss``) on stderr, well within 30 s (an interpreter start and a deadline of a
    few seconds, far from the held call's minutes)."""
    proc, took = _run(code)
    assert proc.returncode == 1 and stamp in proc.stderr, proc
    assert took < 30, took
    return proc


def test_gil_free_deadline_ends_a_call_that_holds_the_gil():
    from dbo.peers.watchdog import gil_free_deadline

    with pytest.raises(ValueError, match="positive"), gil_free_deadline(0):
        pass
    code = ("from dbo.peers.watchdog import gil_free_deadline\n"
            "with gil_free_deadline(0.5):\n" + textwrap.indent(_HOLDS_THE_GIL, "    "))
    proc = _run_to_the_deadline(code, "Timeout (0:00:00")
    assert "<module>" in proc.stderr, proc.stderr


def test_a_call_in_a_named_frame_is_named_in_the_deadlines_stacks():
    from dbo.peers.watchdog import call_in_named_frame

    assert call_in_named_frame("a wait", lambda a, b: divmod(a, b), 7, b=2) == (3, 1)
    code = ("import re\nfrom dbo.peers.watchdog import call_in_named_frame, gil_free_deadline\n"
            "with gil_free_deadline(0.5):\n"
            "    call_in_named_frame('deepep_ht dispatch of ubatch 0 on rank 0: a peer did not arrive',\n"
            "                        re.match, r'(a+)+$', 'a' * 60 + 'b')\n")
    proc = _run_to_the_deadline(code, "Timeout (0:00:00")
    assert ('File "[dbo watchdog] deepep_ht dispatch of ubatch 0 on rank 0: a peer did not arrive", '
            "line 2 in named_wait") in proc.stderr, proc.stderr


def test_gil_free_deadlines_nest_and_a_finished_block_gives_the_outer_one_back():
    # the inner block ends in time; the outer deadline (not the inner, longer one) still holds
    code = ("import time\nfrom dbo.peers.watchdog import gil_free_deadline\n"
            "with gil_free_deadline(1.0):\n"
            "    with gil_free_deadline(60.0):\n        pass\n"
            + textwrap.indent(_HOLDS_THE_GIL, "    "))
    proc, _ = _run(code)
    assert proc.returncode == 1 and "Timeout" in proc.stderr, proc
    # blocks that end in time leave nothing armed
    quick = ("import time\nfrom dbo.peers.watchdog import gil_free_deadline\n"
             "with gil_free_deadline(0.3):\n    pass\ntime.sleep(1.0)\nprint('alive')\n")
    proc, _ = _run(quick)
    assert proc.returncode == 0 and "alive" in proc.stdout, proc


def test_teardown_deadline_ends_a_teardown_that_holds_the_gil():
    # the Python timer cannot run while the GIL is held: the GIL-free deadline, 2 s later, can
    code = ("from dbo.peers.watchdog import teardown_deadline\n"
            "with teardown_deadline(0.3, 'freeing the buffers'):\n" + textwrap.indent(_HOLDS_THE_GIL, "    "))
    _run_to_the_deadline(code, "Timeout (0:00:02")


def test_end_process_within_ends_even_the_interpreters_shutdown():
    # armed after a failure: whatever runs after (here a GIL-holding call at exit) is cut off
    code = ("import atexit, re\nfrom dbo.peers.watchdog import end_process_within, gil_free_deadline\n"
            "atexit.register(lambda: re.match(r'(a+)+$', 'a' * 60 + 'b'))\n"
            "end_process_within(1.0)\n"
            "with gil_free_deadline(30.0):\n    pass\n"  # an inner block does not lift it
            "print('results written', flush=True)\n")
    proc = _run_to_the_deadline(code)
    assert "results written" in proc.stdout, proc


def test_gil_free_deadline_with_a_replaced_stderr():
    # a notebook or a captured test replaces sys.stderr with an object without a descriptor:
    # the deadline still arms (on the process's real stderr) and still ends the stuck call
    code = ("import io, sys\nfrom dbo.peers.watchdog import gil_free_deadline\n"
            "sys.stderr = io.StringIO()\n"
            "with gil_free_deadline(0.5):\n" + textwrap.indent(_HOLDS_THE_GIL, "    "))
    _run_to_the_deadline(code)


def test_gil_free_deadlines_of_several_threads_keep_the_earliest():
    # another thread's block (60 s) that ends first must not take this thread's (1.5 s) with it
    code = ("import threading\nfrom dbo.peers.watchdog import gil_free_deadline\n"
            "opened, close, closed = threading.Event(), threading.Event(), threading.Event()\n"
            "def other():\n"
            "    with gil_free_deadline(60.0):\n"
            "        opened.set()\n"
            "        close.wait()\n"
            "    closed.set()\n"
            "threading.Thread(target=other, daemon=True).start()\n"
            "opened.wait()\n"
            "with gil_free_deadline(1.5):\n"
            "    close.set()\n"
            "    closed.wait()\n" + textwrap.indent(_HOLDS_THE_GIL, "    "))
    _run_to_the_deadline(code, "Timeout (0:00:01")


def test_a_failed_rank_whose_cuda_context_is_lost_ends_at_once():
    # a trapped GPU wait leaves the CUDA context unusable: nothing to tear down, so the teardown
    # after the failure ends the process now (exit 1) instead of waiting out its deadline
    code = ("import atexit, time\nimport torch\nimport dbo.peers.process_group as d\n"
            "d.init_distributed('cpu')\n"
            "class Lost:\n    def query(self):\n"
            "        raise torch.AcceleratorError('CUDA error: unspecified launch failure')\n"
            "torch.cuda.is_available = torch.cuda.is_initialized = lambda: True\n"
            "torch.cuda.current_stream = lambda *a, **k: Lost()\n"
            "assert d.cuda_context_lost()\n"
            "atexit.register(time.sleep, 60)\n"  # a teardown that would wait
            "print('results written', flush=True)\n"
            "d.shutdown_distributed(wait_for_peers=False, deadline_s=30)\n"
            "print('not reached')\n")
    proc, took = _run(code)
    assert proc.returncode == 1 and "results written" in proc.stdout, proc
    assert "not reached" not in proc.stdout and "nothing to tear down" in proc.stderr, proc
    assert took < 25, took


def test_cuda_context_lost_is_false_without_cuda():
    from dbo.peers.process_group import cuda_context_lost

    assert cuda_context_lost() is False
