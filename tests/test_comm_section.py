"""PrepareAndFinalize.comm_section: a backend's stream hand-over under DBO in one block, on the
CPU stand-in for streams (which detects a missing event wait)."""

from __future__ import annotations

import pytest
import torch

from dbo import run_ubatches
from dbo.moe.comm_section import comm_section
from dbo.ubatch.context import dbo_current_context
from dbo.ubatch.streams import current_logical_stream


def test_outside_a_run_nothing_switches_and_capture_is_not_called():
    calls = []
    before = current_logical_stream()
    with comm_section(capture=lambda: calls.append("capture")) as comm:
        assert not comm.in_run and comm.previous_event is None
        assert current_logical_stream() is before
        comm.keep(torch.zeros(2))
    assert calls == [] and current_logical_stream() is before
    comm.wait()  # a no-op


@pytest.mark.parametrize("yield_first", [True, False])
@pytest.mark.parametrize("back", ["sync", "deferred", "plain"])
def test_inside_a_run_the_block_is_on_the_comm_stream(yield_first, back):
    log: list[str] = []

    def ubatch(i: int):
        def body():
            ctx = dbo_current_context()
            log.append(f"{i} start")
            with comm_section(capture=lambda: log.append(f"{i} capture on "
                                                         f"{current_logical_stream().name}") or i,
                              yield_first=yield_first, back=back) as comm:
                assert comm.in_run and comm.previous_event == i
                assert current_logical_stream() is ctx.comm_stream
                log.append(f"{i} comm")
            assert current_logical_stream() is ctx.compute_stream
            comm.wait()
            return i

        return body

    assert run_ubatches([ubatch(0), ubatch(1)], device="cpu") == [0, 1]
    assert log[:2] == ["0 start", "0 capture on compute"]
    # yield_first: the other ubatch starts before this one's communication
    assert (log[2] == "1 start") is yield_first


def test_disabled_or_bad_sections():
    def body():
        with comm_section(enabled=False) as comm:
            assert not comm.in_run
        return 0

    assert run_ubatches([body, body], device="cpu") == [0, 0]
    with pytest.raises(ValueError, match="back must be one of"), comm_section(back="later"):
        pass
