"""LentWork: a collective's wait returns only once nothing the work holds needs the GIL.

A stand-in for gloo's worker thread holds what the collective was given and lets go of it a
moment after the work is complete; the wait must not return before that, and what the collective
holds must not keep any other Python object alive (such an object would be freed by the worker
after the wait returned: at the program's end, inside the interpreter's finalization).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch

from dbo.peers.work import LentWork


class _Done:
    """A work handle whose wait returns at once, as a complete collective's does."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        return True


def test_the_collective_writes_into_the_tensors_through_aliases_that_hold_nothing_else():
    out = torch.zeros(2, 3)[:, 1:]  # a view itself: its base must not be held either
    inp = torch.arange(4.0).reshape(2, 2)
    base, given = weakref.ref(out._base), []

    def issue(o: torch.Tensor, i: torch.Tensor) -> _Done:
        given.extend([o, i])
        o.copy_(i * 2)
        return _Done()

    work = LentWork(issue, [out, inp])
    assert torch.equal(out, inp * 2)
    assert given[0].shape == out.shape and given[0].stride() == out.stride()
    assert given[0].data_ptr() == out.data_ptr()
    # the collective's tensors hold no Python object but their own: the caller's tensors (and a
    # view's base) can be freed while the collective still holds its aliases
    assert given[0]._base is None and given[0] is not out
    del out
    gc.collect()
    assert base() is None
    given.clear()
    assert work.wait()
    assert not work.pending


def test_the_wait_returns_only_after_the_worker_lets_go_of_the_tensors():
    held: list[torch.Tensor] = []
    release_s = 0.05

    def worker() -> None:
        time.sleep(release_s)
        held.clear()  # gloo's thread freeing the work, a moment after it completed

    def issue(t: torch.Tensor) -> _Done:
        held.append(t)
        threading.Thread(target=worker, daemon=True).start()
        return _Done()

    t0 = time.monotonic()
    work = LentWork(issue, [torch.zeros(4)])
    assert work.wait()
    assert time.monotonic() - t0 >= 0.8 * release_s
    assert not held


def test_without_lending_the_collective_gets_the_tensors_themselves():
    t = torch.zeros(3)
    got = []
    work = LentWork(lambda x: got.append(x), [t], lend=False)
    assert got[0] is t
    assert work.wait()
