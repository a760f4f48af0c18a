"""A CUDA error left by a copy-engine GPU wait that trapped (its peer died or stalled) reaches the
transformers integration's user as the CollectiveTimeoutError naming the wait, not as a bare
"unspecified launch failure". The trap itself needs a GPU (tests/gpu/run.sh hffaults:2); here a
transport whose wait event fails stands in for it."""

from __future__ import annotations

import pytest

from dbo.backends.copy_engine.transport import TRANSPORTS
from dbo.errors import CollectiveTimeoutError, UBatchError
from dbo.integrations.transformers.faults import device_fault_for, named_device_faults

CUDA_TRAP = "CUDA error: unspecified launch failure"


class _TrappedEvent:
    def query(self):
        raise RuntimeError(CUDA_TRAP)


class _Transport:
    rank, timeout_s = 1, 3.0

    def __init__(self, failed: bool):
        self.last_wait = {0: (_TrappedEvent(), "the combine of slot 0")} if failed else {}


@pytest.fixture
def transports(monkeypatch):
    live: list = []
    monkeypatch.setattr(TRANSPORTS, "transports", lambda: list(live))
    return live


def test_a_cuda_error_after_a_failed_wait_is_named(transports):
    transports.append(_Transport(failed=True))
    with pytest.raises(CollectiveTimeoutError) as info, named_device_faults():
        raise RuntimeError(CUDA_TRAP)
    assert "rank 1's GPU wait for the combine of slot 0 failed" in str(info.value)
    assert "timeout_s=3.0" in str(info.value) and CUDA_TRAP in str(info.value.__cause__)
    # inside an overlapped run the CUDA error is a ubatch's: the chain is searched
    inner = RuntimeError(CUDA_TRAP)
    wrapped = UBatchError(0, inner)
    wrapped.__cause__ = inner
    assert isinstance(device_fault_for(wrapped), CollectiveTimeoutError)


def test_other_errors_pass_unchanged(transports):
    transports.append(_Transport(failed=False))
    with pytest.raises(RuntimeError, match="unspecified launch failure"), named_device_faults():
        raise RuntimeError(CUDA_TRAP)  # no copy-engine wait failed: not ours to name
    transports.append(_Transport(failed=True))
    with pytest.raises(ValueError, match="bad"), named_device_faults():
        raise ValueError("bad")
    with pytest.raises(KeyError), named_device_faults():
        raise KeyError("x")
    assert device_fault_for(RuntimeError("shape mismatch")) is None


class _FailingStream:
    def synchronize(self):
        raise RuntimeError(CUDA_TRAP)


def test_sync_at_the_end_names_a_wait_that_failed_after_the_block_returned(transports, monkeypatch):
    # a prefill returns before its GPU work ends: the wait that traps late fails at the end of
    # the block (sync=True), named, where a copy-engine GPU wait is live; nowhere else
    import torch

    from dbo.integrations.transformers import faults

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FailingStream())
    with named_device_faults(sync=True):  # no transport: nothing can trap, no sync
        pass
    transport = _Transport(failed=True)
    transport.cuda = False  # a CPU transport's waits never trap
    transports.append(transport)
    assert not faults.gpu_waits_can_trap()
    with named_device_faults(sync=True):
        pass
    transport.cuda = True
    assert faults.gpu_waits_can_trap()
    with named_device_faults():  # sync off: the block returns, the error comes later
        pass
    with pytest.raises(CollectiveTimeoutError, match="rank 1's GPU wait for the combine of slot 0"), \
            named_device_faults(sync=True):
        pass


def test_a_fault_before_a_graph_replay_strikes_at_the_at_th_replay(tmp_path, monkeypatch):
    """``Fault.install_on_graph_replays`` (the GPU runner's faults in replayed decode steps): the
    ``at``-th replay from the install misbehaves first, the others replay untouched, and
    ``remove`` puts the replay back. A recording stand-in replaces ``CUDAGraph.replay`` here."""
    import torch

    from dbo.testing.faults import Fault

    replayed: list = []
    fake = lambda graph: replayed.append(graph)  # noqa: E731
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", fake)
    stamp = tmp_path / "stamp"
    fault = Fault("slow", 2, 0.01, str(stamp))
    fault.install_on_graph_replays()
    torch.cuda.CUDAGraph.replay("g1")
    assert replayed == ["g1"] and not stamp.exists()
    torch.cuda.CUDAGraph.replay("g2")
    assert replayed == ["g1", "g2"] and stamp.exists()  # it misbehaved, then replayed
    written = stamp.read_text()
    torch.cuda.CUDAGraph.replay("g3")
    assert replayed == ["g1", "g2", "g3"] and stamp.read_text() == written  # once only
    fault.remove()
    assert torch.cuda.CUDAGraph.replay is fake
    with pytest.raises(ValueError, match="before a dispatch"):
        Fault("exit_after_combine", 2, 1.0, None).install_on_graph_replays()
