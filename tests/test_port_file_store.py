"""dbo.testing.dist.port_file_store: rank 0 serves a TCPStore on a port the system picks and
hands it over in a file; the other ranks (here: threads) find it there, and a missing rank 0 is
a named timeout, not a hang."""

from __future__ import annotations

import threading

import pytest

from dbo.testing.dist import port_file_store


def test_the_ranks_meet_on_the_port_rank_0_was_given(tmp_path):
    path = str(tmp_path / "store")
    got: dict[int, object] = {}
    stores: dict[int, object] = {}  # alive to the end: rank 0's serves the others

    def rank(r: int) -> None:
        store = stores[r] = port_file_store(path, r, 3, wait_s=30)
        store.set(f"from{r}", str(r))
        got[r] = [store.get(f"from{k}").decode() for k in range(3)]  # waits for every rank's key

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # rank 0 last
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {r: ["0", "1", "2"] for r in range(3)}, got
    assert int((tmp_path / "store").read_text()) > 0


def test_a_rank_whose_rank_0_never_came_says_so(tmp_path):
    with pytest.raises(TimeoutError, match="rank 1: rank 0 did not start the group's store within 0 s"):
        port_file_store(str(tmp_path / "store"), 1, 2, wait_s=0.2)
