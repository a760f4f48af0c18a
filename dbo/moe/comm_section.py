"""A backend's stream hand-over under DBO, in one place: :func:`comm_section`.

Inside a ubatch run a backend's communication runs on the run's comm stream, after this
ubatch's compute so far, and the compute stream takes the result back after it; outside a run
the same code runs on the current stream and nothing switches. Every backend wrote that
protocol itself, as ``if dbo_enabled():`` branches around its library calls; the block below
holds it once:

    with self.comm_section(capture=buffer.capture, back="sync") as comm:
        out = buffer.dispatch(..., previous_event=comm.previous_event)
        comm.keep(payload)  # read by the comm stream after the caller moves on

On entry, inside a run: ``capture()`` is called on the compute stream (its result, DeepEP's
event of this ubatch's compute so far, is ``comm.previous_event``), the ubatch yields (so that
the other ubatch queues its compute ahead of a host wait) and continues on the comm stream,
which waits for this ubatch's compute (``yield_first=False``: no yield). On a normal exit: the
tensors given to :meth:`CommSection.keep` stay alive for the comm stream, those given to
:meth:`CommSection.keep_for_compute` for the compute stream, and the ubatch is back on the
compute stream: after the comm so far (``back="sync"``), without waiting (``"deferred"``:
``comm.wait()`` makes it wait, e.g. once the shared experts are queued) or with no event at
all (``"plain"``: the backend's receiver makes the compute stream wait by its own means). An
exception leaves the block as it is: the run unwinds the ubatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dbo.ubatch.context import (
    dbo_current_context,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_deferred,
    dbo_switch_to_compute_sync,
    dbo_yield_and_switch_from_compute_to_comm,
)
from dbo.ubatch.streams import hand_over

__all__ = ["CommSection", "comm_section", "BACK_MODES"]

#: how a section goes back to the compute stream (see the module docstring)
BACK_MODES = ("sync", "deferred", "plain")


def _noop() -> None:
    return None


class CommSection:
    """What the block of :func:`comm_section` knows: ``in_run`` (inside a ubatch run, on the
    comm stream), ``previous_event`` (``capture()``'s result; None outside a run or without
    ``capture``) and, after a ``back="deferred"`` exit, ``wait`` (makes the compute stream wait
    for the comm; a no-op otherwise)."""

    __slots__ = ("in_run", "previous_event", "wait", "_for_comm", "_for_compute")

    def __init__(self, in_run: bool, previous_event: Any = None):
        self.in_run = in_run
        self.previous_event = previous_event
        self.wait: Callable[[], None] = _noop
        self._for_comm: list[torch.Tensor] = []
        self._for_compute: list[torch.Tensor] = []

    def keep(self, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` alive for what the comm stream has queued on them (inside a run;
        nothing outside)."""
        if self.in_run:
            self._for_comm.extend(tensors)

    def keep_for_compute(self, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` (made on the comm stream) alive for the compute stream's reads."""
        if self.in_run:
            self._for_compute.extend(tensors)


@contextmanager
def comm_section(*, capture: Callable[[], Any] | None = None, yield_first: bool = True,
                 back: str = "sync", enabled: bool = True) -> Iterator[CommSection]:
    """The stream hand-over around a backend's communication (see the module docstring).
    ``enabled=False`` runs the block as outside a run (a backend whose transport needs no comm
    stream, e.g. gloo)."""
    if back not in BACK_MODES:
        raise ValueError(f"back must be one of {BACK_MODES}, got {back!r}")
    if not (enabled and dbo_enabled()):
        yield CommSection(False)
        return
    previous = None if capture is None else dbo_get_previous_event(capture)
    if yield_first:
        dbo_yield_and_switch_from_compute_to_comm()
    else:
        dbo_switch_to_comm_sync()
    section = CommSection(True, previous)
    yield section
    if section._for_comm or section._for_compute:
        ctx = dbo_current_context()
        for t in section._for_comm:
            hand_over(t, ctx.comm_stream)
        for t in section._for_compute:
            hand_over(t, ctx.compute_stream)
    if back == "sync":
        dbo_switch_to_compute_sync()
    elif back == "deferred":
        section.wait = dbo_switch_to_compute_deferred()
    else:
        dbo_switch_to_compute()
