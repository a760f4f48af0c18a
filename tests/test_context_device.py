"""``run_ubatches`` without ``device=`` runs where the work is: CPU work on a machine with a GPU
stays on the CPU stand-in (no CUDA context, no CUDA streams); a process that uses CUDA gets it."""

from __future__ import annotations

import torch

from dbo import dbo_current_context, dbo_yield, run_ubatches
from dbo.ubatch.context import default_run_device
from dbo.ubatch.streams import LogicalStream


def test_cpu_work_where_cuda_is_available_but_unused_runs_on_the_cpu_stand_in(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seen = []

    def body():
        seen.append(type(dbo_current_context().compute_stream))
        dbo_yield()
        return torch.ones(2).sum()

    assert run_ubatches([body, body]) == [2.0, 2.0]
    assert seen == [LogicalStream, LogicalStream]


def test_a_process_that_uses_cuda_gets_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert default_run_device() == "cuda"
    # a CPU comm stream says where the work is, whatever the process uses
    assert default_run_device(LogicalStream("comm")) == "cpu"
