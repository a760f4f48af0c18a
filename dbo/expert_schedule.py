"""Which expert schedule an overlapped forward runs: plain, split, merged, sbo or sbo+dbo.

A schedule is data: one value of :class:`ExpertSchedule`, chosen by
:class:`dbo.split.SplitConfig` (``expert_schedule=``) or by :mod:`dbo.autotune`, carried by the
:class:`dbo.split.UBatchPlan` of each forward, and set for the ubatches of a run by
:func:`dbo.overlap.overlapped_forward` through :func:`use_expert_schedule`. The MoE kernel
(:class:`dbo.moe.MoEKernel`) reads :func:`current_expert_schedule` inside a run; it lives in the
``moe`` layer, which must not import :mod:`dbo.overlap`, so the setting lives here, in the core.

* ``plain``: no split; the forward runs once over the whole batch.
* ``split``: today's DBO; each ubatch runs its own routed experts on its own rows, so the
  expert weights are read once per ubatch.
* ``merged``: once every ubatch of the run has received its tokens (dispatch done), the
  ubatches' routed experts run as one grouped call over the concatenated rows (one weight
  read), then each ubatch takes its rows back and combines them itself. Attention still
  overlaps the dispatch and the next layer's attention still overlaps the combine; the experts
  overlap no communication. It pays where the weights dominate (few rows per expert: decode and
  small prefill batches, or many local experts).
* ``sbo``: single-batch overlap, no split: in each MoE layer the shared experts run while the
  dispatch is in flight, and the routed experts run in groups of local experts whose combines
  leave as each group ends, so a group's combine overlaps the next group's experts (where the
  backend combines per group: :meth:`dbo.moe.PrepareAndFinalize.supports_expert_groups`;
  elsewhere one combine). The weights are read once, and nothing is split.
* ``sbo+dbo``: split into ubatches as ``split``, each laid out as ``sbo`` inside the run: its
  shared experts queued beside its dispatch, its routed experts in groups whose combines leave
  as each group ends. Each group's combine is in flight while the other ubatch's work (and this
  ubatch's next group, queued before the yield) runs, so a combine overlaps compute at the
  granularity of an expert group rather than of a whole ubatch's experts.

The setting is a ``contextvars.ContextVar``: every ubatch starts with a copy of the caller's
context, so a value set around ``run_ubatches`` reaches every ubatch of that run and nothing
else (not other threads, not other runs).
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ExpertSchedule", "parse_expert_schedule", "current_expert_schedule",
           "use_expert_schedule", "current_sbo_groups", "use_sbo_groups", "check_sbo_groups"]


class ExpertSchedule(str, enum.Enum):
    """How the routed experts of an overlapped forward run (see the module docstring)."""

    PLAIN = "plain"    #: no split
    SPLIT = "split"    #: each ubatch runs its own experts
    MERGED = "merged"  #: one grouped call over every ubatch's received rows
    SBO = "sbo"        #: no split; shared experts beside the dispatch, combines per expert group
    SBO_DBO = "sbo+dbo"  #: split, and each ubatch laid out as ``sbo``

    @property
    def splits(self) -> bool:
        """True for the schedules that run the forward as ubatches (``split``, ``merged``,
        ``sbo+dbo``)."""
        return self in (ExpertSchedule.SPLIT, ExpertSchedule.MERGED, ExpertSchedule.SBO_DBO)

    @property
    def grouped(self) -> bool:
        """True for the schedules whose MoE layers combine per expert group and run the shared
        experts beside the dispatch (``sbo``, ``sbo+dbo``)."""
        return self in (ExpertSchedule.SBO, ExpertSchedule.SBO_DBO)

    def __str__(self) -> str:
        return self.value


def parse_expert_schedule(value: ExpertSchedule | str) -> ExpertSchedule:
    """``value`` as an :class:`ExpertSchedule`.

    Raises:
        ValueError: ``value`` names no schedule.
    """
    try:
        return ExpertSchedule(value)
    except ValueError:
        raise ValueError(f"expert_schedule must be one of {[s.value for s in ExpertSchedule]}, "
                         f"got {value!r}") from None


_SCHEDULE: contextvars.ContextVar[ExpertSchedule] = contextvars.ContextVar(
    "dbo_expert_schedule", default=ExpertSchedule.SPLIT)


def current_expert_schedule() -> ExpertSchedule:
    """The schedule set for this context (``split`` unless :func:`use_expert_schedule` set
    another). The MoE kernel merges only inside a run of two or more ubatches, runs ``sbo``
    only outside a run and ``sbo+dbo`` only inside one."""
    return _SCHEDULE.get()


@contextmanager
def use_expert_schedule(schedule: ExpertSchedule | str) -> Iterator[ExpertSchedule]:
    """Within the block (and in the ubatches of a ``run_ubatches`` started inside it), the MoE
    kernels run ``schedule``; the previous setting is restored on exit.

    Raises:
        ValueError: ``schedule`` names no schedule.
    """
    value = parse_expert_schedule(schedule)
    token = _SCHEDULE.set(value)
    try:
        yield value
    finally:
        _SCHEDULE.reset(token)


_SBO_GROUPS: contextvars.ContextVar[int | None] = contextvars.ContextVar("dbo_sbo_groups", default=None)


def check_sbo_groups(groups: int | None) -> None:
    """Raises ``ValueError`` unless ``groups`` is None or an int >= 1."""
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
        raise ValueError(f"sbo_groups must be None or an int >= 1, got {groups!r}")


def current_sbo_groups() -> int | None:
    """The expert groups of the grouped schedules (``sbo``, ``sbo+dbo``) set for this context, or
    None: each MoE kernel's own :attr:`dbo.moe.MoEKernel.sbo_groups`."""
    return _SBO_GROUPS.get()


@contextmanager
def use_sbo_groups(groups: int | None) -> Iterator[int | None]:
    """Within the block (and its ubatches), the grouped schedules combine in ``groups`` expert
    groups in every MoE kernel (None: each kernel's own); restored on exit.

    Raises:
        ValueError: not None or an int >= 1.
    """
    check_sbo_groups(groups)
    token = _SBO_GROUPS.set(groups)
    try:
        yield groups
    finally:
        _SBO_GROUPS.reset(token)
