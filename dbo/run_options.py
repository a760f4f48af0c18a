"""How an overlapped call runs: :class:`RunOptions`, the one checked value of the options that
:func:`dbo.overlapped_forward`, :class:`dbo.DBOWrapper` and :func:`dbo.autotune.autotune_split_config`
take (trace, comm stream, SM carve-out, compute SMs, peer timeout), the one way they are set for
a call (:meth:`RunOptions.applied` and :meth:`RunOptions.ubatch_args`), and the run's device.

Every per-run setting is set on entry to the call and restored on exit (also on an exception),
and read where it is used: the expert schedule, the peer timeout and the experts' SM carve-out
travel in context variables (each ubatch starts with a copy of the caller's context, so they
reach every ubatch of the run, and every MoE layer and experts object the forward calls,
wherever a model keeps them); torch's process-wide carve-out is set around the whole run; the
trace, comm stream and compute SMs are arguments of :func:`dbo.run_ubatches`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dbo.expert_schedule import ExpertSchedule, check_sbo_groups, use_expert_schedule, use_sbo_groups
from dbo.peers.watchdog import check_timeout, collective_timeout
from dbo.ubatch.sm import check_compute_sms, check_sm_carveout, sm_carveout
from dbo.ubatch.trace import Trace

__all__ = ["RunOptions", "run_device"]

#: the fields of :class:`RunOptions`, the loose keywords the entry points also take
RUN_OPTION_NAMES = ("trace", "comm_stream", "sm_carveout", "compute_sms", "timeout_s", "sbo_groups")


@dataclass(frozen=True)
class RunOptions:
    """How the overlapped calls of :func:`overlapped_forward` and :class:`DBOWrapper` run,
    checked once, when made (a bad value raises ``ValueError``/``TypeError`` here).

    Attributes:
        trace: a :class:`dbo.Trace` that records the overlapped run (None: none).
        comm_stream: the comm stream for ``run_ubatches`` (None: its own).
        sm_carveout: SMs the matmuls leave free while the ubatches run (torch's carve-out and
            that of every :class:`dbo.experts.SwiGLUExperts` the forward calls); None leaves
            both alone. A plain call runs without it.
        compute_sms: SMs of the green context the ubatches compute on; None: every SM. A plain
            call runs without it.
        timeout_s: the longest wait for a peer rank in every backend, split or not; None keeps
            each backend's own.
        sbo_groups: the expert groups the grouped schedules (``sbo``, ``sbo+dbo``) combine in,
            in every MoE kernel the call runs; None keeps each kernel's own
            (:attr:`dbo.moe.MoEKernel.sbo_groups`).
    """

    trace: Trace | None = None
    comm_stream: Any = None
    sm_carveout: int | None = None
    compute_sms: int | None = None
    timeout_s: float | None = None
    sbo_groups: int | None = None

    def __post_init__(self) -> None:
        check_sbo_groups(self.sbo_groups)
        check_sm_carveout(self.sm_carveout)
        check_compute_sms(self.compute_sms)
        check_timeout(self.timeout_s)

    @classmethod
    def given(cls, options: RunOptions | None, **keywords: Any) -> RunOptions:
        """The options of an entry point that takes both ``options=`` and the loose keywords
        (``trace=``, ``comm_stream=``, ``sm_carveout=``, ``compute_sms=``, ``timeout_s=``):
        ``options``, or the keywords made into one (None counts as not given).

        Raises:
            TypeError: ``options`` is not a RunOptions, or it was given with a keyword that is
                not None; a keyword that is not a run option.
            ValueError: a bad value (as :class:`RunOptions` checks it).
        """
        unknown = sorted(set(keywords) - set(RUN_OPTION_NAMES))
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not a run option; they are {', '.join(RUN_OPTION_NAMES)}")
        if options is None:
            return cls(**keywords)
        if not isinstance(options, RunOptions):
            raise TypeError(f"options must be a RunOptions, got {type(options).__name__}")
        both = [k for k, v in keywords.items() if v is not None]
        if both:
            raise TypeError(f"give the run options as options= or as keywords, not both: got "
                            f"options= and {both[0]}=")
        return options

    @contextlib.contextmanager
    def applied(self, expert_schedule: ExpertSchedule | str, *, overlapped: bool) -> Iterator[None]:
        """For the block, one call's settings that travel by context: ``expert_schedule``
        (:func:`dbo.expert_schedule.use_expert_schedule`), :attr:`timeout_s`
        (:func:`dbo.peers.watchdog.collective_timeout`), :attr:`sbo_groups`
        (:func:`dbo.expert_schedule.use_sbo_groups`) and, for an ``overlapped`` call,
        :attr:`sm_carveout` (:func:`dbo.ubatch.sm.sm_carveout`: torch's for cuBLAS, and that of
        dbo's experts). Each is restored on exit, also on an exception. The other fields go to
        ``run_ubatches`` (:meth:`ubatch_args`).

        Raises:
            ValueError: ``expert_schedule`` names no schedule.
        """
        with contextlib.ExitStack() as stack:
            if overlapped:
                stack.enter_context(sm_carveout(self.sm_carveout))
            stack.enter_context(use_expert_schedule(expert_schedule))
            stack.enter_context(use_sbo_groups(self.sbo_groups))
            stack.enter_context(collective_timeout(self.timeout_s))
            yield

    def ubatch_args(self) -> dict[str, Any]:
        """The keyword arguments of :func:`dbo.run_ubatches` these options set (``trace``,
        ``comm_stream``, ``compute_sms``)."""
        return {"trace": self.trace, "comm_stream": self.comm_stream, "compute_sms": self.compute_sms}


def run_device(t: torch.Tensor) -> torch.device | str:
    """The device the ubatches of a call on ``t`` run on: ``t``'s own (CUDA, with its index),
    or the CPU stand-in for any other (run_ubatches' default only knows whether the process
    uses CUDA, not where these inputs are)."""
    return t.device if t.device.type == "cuda" else "cpu"
