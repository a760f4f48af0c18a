"""Run a model forward as overlapped ubatches: split the inputs, ``run_ubatches``, merge.

:func:`overlapped_forward` (a function) and :class:`DBOWrapper` (an ``nn.Module`` around a
module or any callable) take token-major tensors ``[num_tokens, ...]``. They decide the split
with :func:`dbo.split.plan_ubatches` (one all-reduce over the expert-parallel group), cut every
input at the plan's slices, pad each ubatch to the plan's ``padded_size`` with zero rows, run
the ubatches with :func:`dbo.run_ubatches` (``token_offsets`` = each slice's first row), and
concatenate the outputs in ubatch order without the padding rows. When the plan does not split
(below threshold, ranks disagree, ``DBO_DISABLE=1``) they call the plain forward instead.

Padding rows must route to no expert. Code inside the forward finds its ubatch with
:func:`current_ubatch` (None in a plain forward) and masks its routing with
:func:`mask_current_padding`; each ubatch has its own value because every ubatch runs in its
own copy of the caller's ``contextvars`` context.

How a call runs is one :class:`RunOptions` (``options=``, or the same fields as loose keywords),
set for the call on entry and restored on exit (:meth:`RunOptions.applied`). SMs for the
communication: ``sm_carveout=N`` leaves ``N`` SMs free in the overlapped runs' matmuls: torch's
carve-out for cuBLAS and that of every :class:`dbo.experts.SwiGLUExperts` the forward calls
(its persistent grids, wherever the model keeps them), both through
:func:`dbo.ubatch.sm.sm_carveout`. ``compute_sms=N`` runs the compute on a green context of
``N`` SMs (:func:`dbo.ubatch.sm.compute_on_sms`).

CUDA graphs: given a precomputed ``plan=``, nothing on this path syncs with the host. Slicing
and padding use Python ints from the plan, the merge is one ``torch.cat`` per output, and the
ubatch context reuses its comm stream and events across runs. Without ``plan=`` the decision's
all-reduce reads its result back on the host (one ``.tolist()``): decide before capture, or
capture one graph per plan.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.deployment import DeploymentConfig
from dbo.expert_schedule import ExpertSchedule
from dbo.peers.watchdog import collective_timeout
from dbo.run_options import RunOptions, run_device
from dbo.split import (
    SplitConfig,
    SplitReason,
    UBatchPlan,
    check_token_major,
    mask_padding_routing,
    merge_outputs,
    no_split_plan,
    plan_ubatches,
    split_inputs,
)
from dbo.split.online import OnlineChoice
from dbo.ubatch.context import run_ubatches
from dbo.ubatch.trace import Trace

__all__ = [
    "RunOptions",
    "UBatchInfo",
    "current_ubatch",
    "current_num_valid_tokens",
    "mask_current_padding",
    "overlapped_forward",
    "DBOWrapper",
]


@dataclass(frozen=True)
class UBatchInfo:
    """What a ubatch's forward knows about its rows.

    ``start``/``stop``: the parent-batch rows of its real tokens; ``padded_size``: rows of its
    inputs; rows ``num_valid:`` are padding.
    """

    index: int
    num_ubatches: int
    start: int
    stop: int
    padded_size: int

    @property
    def num_valid(self) -> int:
        return self.stop - self.start


_CURRENT: contextvars.ContextVar[UBatchInfo | None] = contextvars.ContextVar("dbo_ubatch", default=None)


def current_ubatch() -> UBatchInfo | None:
    """The running ubatch of an :func:`overlapped_forward`, or None in a plain forward."""
    return _CURRENT.get()


def current_num_valid_tokens(num_rows: int) -> int:
    """Real rows among the ``num_rows`` of this forward's inputs: the ubatch's ``num_valid``
    inside a split forward, else ``num_rows``."""
    info = _CURRENT.get()
    return num_rows if info is None else min(info.num_valid, num_rows)


def mask_current_padding(topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give the current ubatch's padding rows ``topk_ids`` -1 and weight 0 (a no-op in a plain
    forward or a ubatch without padding).

    Args:
        topk_ids: ``[num_rows, topk]`` integer expert ids of this forward's rows.
        topk_weights: ``[num_rows, topk]`` float routing weights.
    Returns:
        ``(topk_ids, topk_weights)``, new tensors when any row is padding. No host sync.
    """
    return mask_padding_routing(topk_ids, topk_weights, current_num_valid_tokens(topk_ids.shape[0]))


# ---- the overlapped forward ----------------------------------------------------------------


def overlapped_forward(
    fn: Callable[..., Any],
    *tensors: torch.Tensor,
    plan: UBatchPlan | None = None,
    config: SplitConfig | None = None,
    request_token_counts: Sequence[int] | None = None,
    decode_only: bool | None = None,
    group: Any = None,
    agree: bool = True,
    trace: Trace | None = None,
    comm_stream: Any = None,
    fn_kwargs: Mapping[str, Any] | None = None,
    sm_carveout: int | None = None,
    compute_sms: int | None = None,
    timeout_s: float | None = None,
    options: RunOptions | None = None,
) -> Any:
    """``fn(*tensors, **fn_kwargs)``, run as overlapped ubatches when the plan splits.

    Args:
        fn: the forward; takes token-major tensors and returns token-major tensors (or
            tuples/lists/dicts of them) with one row per input row. It should call
            :func:`dbo.dbo_yield` (directly or through the MoE layer) so that ubatches
            interleave, and route rows past :func:`current_num_valid_tokens` to no expert.
        tensors: inputs ``[num_tokens, ...]``, any dtype, all with the same ``num_tokens``.
        plan: a precomputed :class:`UBatchPlan` for these ``num_tokens`` (skips the decision
            and its all-reduce; needed under CUDA graph capture). Its ``padded_size`` and
            ``expert_schedule`` must be the same on every rank of the group.
        config, request_token_counts, decode_only, group, agree: passed to
            :func:`dbo.split.plan_ubatches` when ``plan`` is None.
        trace: a :class:`dbo.Trace` that records the overlapped run.
        comm_stream: the comm stream for ``run_ubatches`` (default: its own).
        fn_kwargs: keyword arguments given unchanged to every call of ``fn``.
        sm_carveout: SMs the matmuls leave free while the ubatches run: torch's carve-out and
            that of every :class:`dbo.experts.SwiGLUExperts` ``fn`` calls
            (:func:`dbo.ubatch.sm.sm_carveout`); None (default) leaves both alone. A plain
            (unsplit) call runs without it.
        compute_sms: run the ubatches' compute on a CUDA green context of this many SMs,
            leaving the others to the communication kernels (see
            :func:`dbo.ubatch.sm.compute_on_sms`); None (default) uses every SM. A plain call
            runs without it.
        timeout_s: the longest wait for a peer rank in every backend called by ``fn``, split
            or not (:func:`dbo.peers.watchdog.collective_timeout`); None keeps each backend's own.
        options: the five above as one :class:`RunOptions` (then leave them out).

    The plan's ``expert_schedule`` (from ``config.expert_schedule`` when the plan is decided
    here) is set for the ubatches (:func:`dbo.expert_schedule.use_expert_schedule`): with
    ``merged`` every :class:`dbo.moe.MoEKernel` runs its routed experts once over all ubatches'
    rows. A ``trace`` records it in ``trace.meta["expert_schedule"]``.

    Returns:
        ``fn``'s output for all ``num_tokens`` rows, in input order (same structure).

    Raises:
        ValueError/TypeError: inputs that are not token-major, a plan for another size, a bad
            ``sm_carveout``, ``compute_sms`` or ``timeout_s``; ``options`` together with one of
            them (``TypeError``).
        dbo.UBatchError: a ubatch raised (``__cause__`` is its exception; a peer that did not
            arrive in time: :class:`dbo.errors.CollectiveTimeoutError`).
        dbo.errors.CollectiveTimeoutError: the same, in a plain (unsplit) call.
        dbo.ubatch.sm.SMPartitionUnsupportedError: ``compute_sms`` without green contexts.
    """
    num_tokens = check_token_major(tensors)
    options = RunOptions.given(options, trace=trace, comm_stream=comm_stream, sm_carveout=sm_carveout,
                               compute_sms=compute_sms, timeout_s=timeout_s)
    if plan is None:
        with collective_timeout(options.timeout_s):  # the vote waits for the peers too
            plan = plan_ubatches(num_tokens, config, request_token_counts=request_token_counts,
                                 decode_only=decode_only, group=group, agree=agree)
    return _run_plan(fn, tensors, num_tokens, plan, dict(fn_kwargs or {}), options)


def _run_plan(fn: Callable[..., Any], tensors: Sequence[torch.Tensor], num_tokens: int,
              plan: UBatchPlan, kwargs: dict[str, Any], options: RunOptions) -> Any:
    """:func:`overlapped_forward` once the plan is known."""
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan is for {plan.num_tokens} tokens, the inputs have {num_tokens}")
    if not plan.split:  # plain, or sbo: the MoE kernels overlap within the one batch
        with options.applied(plan.expert_schedule, overlapped=False):
            return fn(*tensors, **kwargs)

    inputs = split_inputs(plan, tensors)
    n = plan.num_ubatches

    def body(i: int) -> Callable[[], Any]:
        start, stop = plan.slices[i]
        info = UBatchInfo(i, n, start, stop, plan.padded_size)
        args = inputs[i]

        def run() -> Any:
            _CURRENT.set(info)  # this ubatch's own contextvars context: no leak to the others
            return fn(*args, **kwargs)

        return run

    if options.trace is not None:
        options.trace.meta["expert_schedule"] = plan.expert_schedule.value
    with options.applied(plan.expert_schedule, overlapped=True):
        outputs = run_ubatches([body(i) for i in range(n)], token_offsets=plan.token_offsets,
                               device=run_device(tensors[0]), **options.ubatch_args())
    return merge_outputs(plan, outputs)


class _RunOption:
    """A :class:`DBOWrapper` attribute that reads one field of its :attr:`~DBOWrapper.options`
    and, when set, replaces them with the new value (checked by :class:`RunOptions`)."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.options = dataclasses.replace(obj.options, **{self.name: value})


class DBOWrapper(torch.nn.Module):
    """A module (or any forward function) whose calls run as overlapped ubatches.

    ``DBOWrapper(model, config, group=ep_group)(x, positions)`` is
    ``overlapped_forward(model, x, positions, ...)``; keyword arguments other than those below
    go to the model unchanged. A wrapped ``nn.Module`` is a submodule (``.to()``,
    ``state_dict()`` reach it). ``last_plan`` is the plan of the latest call.

    With ``config.adaptive`` (the default :class:`SplitConfig`'s; an autotuned config's is
    False) a batch the plan splits is not simply overlapped: at each size bucket the first calls
    run plainly and with each expert schedule in turn, timed, and the bucket keeps the fastest
    (an overlapped schedule only if it beats the plain forward by 2%), measured again every
    thousand calls (:class:`dbo.split.online.OnlineChoice`, in :attr:`online`). With the default
    candidates a bucket decides after 16 calls (``online.calls_to_decide``): four candidates, each
    one warm-up and three timed calls. Meanwhile ``last_plan.detail`` says so (``"measuring ~4096
    tokens: call 5 of 16, split (warm-up)"``; an unsplit call's ``last_plan.reason`` is
    ``SplitReason.MEASURING``) and ``online.table()`` lists the timings so far; each decision is
    one WARNING line on the ``dbo.split.online`` logger. A call given ``plan=`` runs that plan
    as it is.

    Args:
        module_or_fn: the forward (an ``nn.Module`` or a callable).
        config: the default :class:`SplitConfig`, or a tuned deployment's
            :class:`dbo.deployment.DeploymentConfig` (:func:`dbo.deployment.load_deployment_config`
            reads one): its split config, and its ``sm_carveout`` and ``sbo_groups`` where the
            run options leave them None.
        group: the process group that must agree on the split (default: the default group).
        agree: False skips the agreement all-reduce.
        trace: a default :class:`dbo.Trace` for every overlapped call.
        comm_stream: passed to ``run_ubatches``.
        sm_carveout: SMs the matmuls (torch's and the wrapped forward's experts') leave free in
            overlapped calls, as in :func:`overlapped_forward`; an attribute, checked when set.
        compute_sms: SMs of the green context the overlapped calls compute on (see
            :func:`dbo.ubatch.sm.compute_on_sms`); an attribute, checked when set, the green
            context created on first use.
        timeout_s: the longest wait for a peer rank in the backends, as in
            :func:`overlapped_forward` (None: each backend's own).
        options: the five above as one :class:`RunOptions` (then leave them out), which also
            holds ``sbo_groups``; with a deployment ``config``, its ``sm_carveout`` and
            ``sbo_groups`` fill those left None.

    The five are one :class:`RunOptions` (:attr:`options`); each is also an attribute that
    replaces it with the new value, checked.
    """

    def __init__(self, module_or_fn: torch.nn.Module | Callable[..., Any],
                 config: SplitConfig | DeploymentConfig | None = None, *, group: Any = None,
                 agree: bool = True,
                 trace: Trace | None = None, comm_stream: Any = None,
                 sm_carveout: int | None = None, compute_sms: int | None = None,
                 timeout_s: float | None = None, options: RunOptions | None = None):
        super().__init__()
        options = RunOptions.given(options, trace=trace, comm_stream=comm_stream, sm_carveout=sm_carveout,
                                   compute_sms=compute_sms, timeout_s=timeout_s)
        if not callable(module_or_fn):
            raise TypeError(f"module_or_fn must be callable, got {type(module_or_fn).__name__}")
        if isinstance(module_or_fn, torch.nn.Module):
            self.module = module_or_fn
        else:
            self._fn = module_or_fn
        if isinstance(config, DeploymentConfig):  # a tuned deployment's file (dbo.deployment)
            if options.sm_carveout is None:
                options = dataclasses.replace(options, sm_carveout=config.sm_carveout)
            if options.sbo_groups is None:
                options = dataclasses.replace(options, sbo_groups=config.sbo_groups)
            config = config.split
        self.config = SplitConfig() if config is None else config
        self.group = group
        self.agree = agree
        #: how the overlapped calls run (the attributes below read and replace it)
        self.options = options
        self.last_plan: UBatchPlan | None = None
        #: the measured choice between plain and overlapped per size bucket (``config.adaptive``)
        self.online: OnlineChoice | None = None

    @property
    def fn(self) -> Callable[..., Any]:
        return self.module if "module" in self._modules else self._fn

    trace = _RunOption("The :class:`dbo.Trace` of every overlapped call (None: none).")
    comm_stream = _RunOption("The comm stream given to ``run_ubatches`` (None: its own).")
    timeout_s = _RunOption("The longest wait for a peer rank in the backends (None: each backend's own).")
    compute_sms = _RunOption("SMs of the overlapped calls' green context (None: every SM).")
    sm_carveout = _RunOption("SMs left free in the overlapped calls (None: torch's and the "
                             "experts' own setting).")

    def plan(self, num_tokens: int, *, request_token_counts: Sequence[int] | None = None,
             decode_only: bool | None = None, need_bytes: int | None = None) -> UBatchPlan:
        """The plan a call with ``num_tokens`` rows would use (issues the all-reduce;
        ``need_bytes`` as in :func:`dbo.split.plan_ubatches`)."""
        return plan_ubatches(num_tokens, self.config, request_token_counts=request_token_counts,
                             decode_only=decode_only, group=self.group, agree=self.agree,
                             need_bytes=need_bytes)

    def forward(self, *tensors: torch.Tensor, plan: UBatchPlan | None = None,
                request_token_counts: Sequence[int] | None = None,
                decode_only: bool | None = None, trace: Trace | None = None,
                need_bytes: int | None = None, **kwargs: Any) -> Any:
        """Run the wrapped forward on token-major ``tensors``; see :func:`overlapped_forward`.
        ``need_bytes``: this rank's device memory need even unsplit, checked on every rank
        before the call (:func:`dbo.split.plan_ubatches`)."""
        num_tokens = check_token_major(tensors)
        options = self.options if trace is None else dataclasses.replace(self.options, trace=trace)
        if plan is None:
            plan = self.plan(num_tokens, request_token_counts=request_token_counts,
                             decode_only=decode_only, need_bytes=need_bytes)
            if plan.split and self.config.adaptive:
                return self._measured(plan, tensors, num_tokens, kwargs, options)
        return self._run(plan, tensors, num_tokens, kwargs, options)

    def _run(self, plan: UBatchPlan, tensors: Sequence[torch.Tensor], num_tokens: int,
             kwargs: dict[str, Any], options: RunOptions) -> Any:
        self.last_plan = plan
        return _run_plan(self.fn, tensors, num_tokens, plan, kwargs, options)

    def _measured(self, plan: UBatchPlan, tensors: Sequence[torch.Tensor], num_tokens: int,
                  kwargs: dict[str, Any], options: RunOptions) -> Any:
        """A split call under ``config.adaptive``: :attr:`online` picks plain or a schedule."""
        if self.online is None:
            self.online = OnlineChoice(group=self.group, agree=self.agree)

        online = self.online

        def call(schedule: ExpertSchedule) -> Any:
            measuring = online.progress(plan)  # this call's place in the measurement, if any
            if not schedule.splits:
                p = no_split_plan(num_tokens,
                                  SplitReason.MEASURED if measuring is None else SplitReason.MEASURING,
                                  measuring or f"the unsplit {schedule} forward measured fastest "
                                  f"at this size", expert_schedule=schedule)
            else:
                p = dataclasses.replace(plan, expert_schedule=schedule,
                                        detail=measuring or f"{schedule} measured fastest at this size")
            return self._run(p, tensors, num_tokens, kwargs, options)

        return self.online.run(plan, call, device=tensors[0].device)
