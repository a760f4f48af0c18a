"""How an overlapped call runs: :class:`RunOptions`, the one checked value of the options that
:func:`dbo.overlapped_forward` and :class:`dbo.DBOWrapper` take (trace, comm stream, SM carve-out,
compute SMs, peer timeout), and the helpers their plan runner uses with it: the run's device and
the SMs the matmuls leave free for the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dbo.peers.watchdog import check_timeout
from dbo.ubatch.sm import check_compute_sms, check_sm_carveout
from dbo.ubatch.sm import sm_carveout as torch_sm_carveout
from dbo.ubatch.trace import Trace

__all__ = ["RunOptions", "run_device", "leave_sms_free"]


@dataclass(frozen=True)
class RunOptions:
    """How the overlapped calls of :func:`overlapped_forward` and :class:`DBOWrapper` run,
    checked once, when made (a bad value raises ``ValueError``/``TypeError`` here).

    Attributes:
        trace: a :class:`dbo.Trace` that records the overlapped run (None: none).
        comm_stream: the comm stream for ``run_ubatches`` (None: its own).
        sm_carveout: SMs the matmuls leave free while the ubatches run (torch's carve-out and
            that of the forward's experts); None leaves both alone. A plain call runs without it.
        compute_sms: SMs of the green context the ubatches compute on; None: every SM. A plain
            call runs without it.
        timeout_s: the longest wait for a peer rank in every backend, split or not; None keeps
            each backend's own.
    """

    trace: Trace | None = None
    comm_stream: Any = None
    sm_carveout: int | None = None
    compute_sms: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_sm_carveout(self.sm_carveout)
        check_compute_sms(self.compute_sms)
        check_timeout(self.timeout_s)


def run_device(t: torch.Tensor) -> torch.device | str:
    """The device the ubatches of a call on ``t`` run on: ``t``'s own (CUDA, with its index),
    or the CPU stand-in for any other (run_ubatches' default only knows whether the process
    uses CUDA, not where these inputs are)."""
    return t.device if t.device.type == "cuda" else "cpu"


@contextlib.contextmanager
def leave_sms_free(find_experts: Callable[[], list], num_sms: int | None) -> Iterator[None]:
    """For the block: torch's carve-out of ``num_sms`` (cuBLAS) and the same ``sm_carveout`` on
    the SwiGLUExperts ``find_experts()`` gives (their persistent grids); both put back on exit.
    ``num_sms`` was checked where it came in; None does nothing (and finds nothing)."""
    if num_sms is None:
        yield
        return
    experts = find_experts()
    saved = [e.sm_carveout for e in experts]
    with torch_sm_carveout(num_sms):
        for e in experts:
            e.sm_carveout = num_sms
        try:
            yield
        finally:
            for e, k in zip(experts, saved, strict=True):
                e.sm_carveout = k
