"""The MoE kernel: drives a prepare/finalize backend and the experts through the ubatch context.

Under DBO a backend's ``prepare_async``/``finalize_async`` may return ``(hook, receiver)``; the
kernel hands the hook to the ubatch context and yields, so another ubatch's compute runs while
the all-to-all is in flight, then calls the receiver. Shared experts run while the combine is
in flight. Without DBO the same code runs the hook in place.

With the ``merged`` expert schedule (:func:`dbo.expert_schedule.current_expert_schedule`, set
by the overlapped forward for its run) the routed experts of all ubatches run as one call after
every ubatch's dispatch (:mod:`dbo.moe.merged`); prepare and finalize stay per ubatch.

With the ``sbo`` schedule (single-batch overlap: outside a run, the batch unsplit) the shared
experts run while the dispatch is in flight (a backend whose dispatch copies hold the current
stream, :meth:`~dbo.moe.PrepareAndFinalize.dispatch_holds_stream`, launches it from a side
stream, which the compute stream waits for before the receive), and, where the backend
combines per expert group
(:meth:`~dbo.moe.PrepareAndFinalize.supports_expert_groups`) and the activations are
BATCHED_EXPERTS slabs, the routed experts run in :attr:`MoEKernel.sbo_groups` groups of local
experts: group ``g``'s combine is launched as soon as its experts are queued, so it runs (on the
backend's stream) beside group ``g + 1``'s experts. Each group's combine brings that group's
share of every token's weighted sum; the shares are added. Elsewhere the routed experts run
once and one combine follows.

With ``sbo+dbo`` (inside a run) each ubatch's layer is laid out the same way: its shared experts
are queued right after its dispatch is launched, before it yields, and its routed experts run in
groups; group ``g``'s combine is launched once group ``g``'s experts are queued and completed
(its receive hook handed to the other ubatch, then a yield) once group ``g + 1``'s experts are
queued, so each combine is in flight beside the other ubatch's work and this ubatch's next group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from dbo.expert_schedule import ExpertSchedule, current_expert_schedule, current_sbo_groups
from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEExperts,
    PrepareAndFinalize,
    PrepareResult,
    Workspace,
    WorkspacePool,
)
from dbo.moe.errors import MoEProtocolError
from dbo.moe.merged import ExpertsInput, ExpertsRendezvous, same_call_key
from dbo.ubatch.context import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_num_ubatches,
    dbo_region,
    dbo_register_recv_hook,
    dbo_yield,
)
from dbo.ubatch.sm import experts_sm_carveout

__all__ = ["MoEKernel", "SBO_GROUPS", "expert_groups"]

#: groups of local experts under the ``sbo`` schedule, by default: with two, DeepEP's
#: low-latency mode holds at most two results at once (the dispatch's and the first combine's)
SBO_GROUPS = 2


def expert_groups(num_local: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` ranges ``(start, stop)`` of local experts as equal as can be, covering
    ``0..num_local`` in order (fewer when there are fewer experts than groups)."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    g = max(1, min(groups, num_local))
    bounds = [i * num_local // g for i in range(g + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(g)]

logger = logging.getLogger(__name__)


def _complete(res: Any, recv_region: str) -> Any:
    """Run the hook protocol on a ``receiver`` or ``(hook, receiver)`` and call the receiver."""
    if isinstance(res, tuple):
        hook, receiver = res
        if dbo_enabled():
            dbo_register_recv_hook(hook)
            dbo_yield()
        else:
            hook()
    else:
        receiver = res
    with dbo_region(recv_region):
        return receiver()


class MoEKernel:
    """A modular MoE layer: ``prepare`` (dispatch), experts, ``finalize`` (combine).

    Args:
        prepare_finalize: the all-to-all backend.
        experts: the expert computation; must accept the backend's activation format.
        shared_experts: optional ``f(hidden_states [M, hidden]) -> [M, hidden]`` run on the
            local tokens while the combine is in flight; its output is added to the routed one.
        workspaces: the scratch buffers, shared with the model's other MoE layers
            (:class:`~dbo.moe.WorkspacePool`, which says when sharing is safe); None: its own.

    Scratch buffers are kept per ubatch (indexed by ``dbo_current_ubatch_id()``), so one kernel
    object serves every ubatch of a run. Under the ``merged`` expert schedule the kernel is
    also where its ubatches meet (:class:`dbo.moe.merged.ExpertsRendezvous`); the merged call
    has scratch buffers of its own.
    """

    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: MoEExperts,
                 shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 workspaces: WorkspacePool | None = None):
        if not isinstance(prepare_finalize, PrepareAndFinalize):
            raise TypeError(f"prepare_finalize must be a PrepareAndFinalize, got "
                            f"{type(prepare_finalize).__name__}")
        if not isinstance(experts, MoEExperts):
            raise TypeError(f"experts must be a MoEExperts, got {type(experts).__name__}")
        fmt = prepare_finalize.activation_format
        if fmt not in experts.supported_activation_formats():
            raise ValueError(
                f"experts {type(experts).__name__} do not accept the activation format {fmt.name} "
                f"that {type(prepare_finalize).__name__} produces"
            )
        if shared_experts is not None and not callable(shared_experts):
            raise TypeError("shared_experts must be callable or None")
        if workspaces is not None and not isinstance(workspaces, WorkspacePool):
            raise TypeError(f"workspaces must be a WorkspacePool or None, got {type(workspaces).__name__}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts
        #: the per-ubatch scratch buffers (shared with the model's other layers where given)
        self.workspaces = WorkspacePool() if workspaces is None else workspaces
        self._sbo_stream: Any = None  # see _side_stream
        self._group_workspaces: dict[tuple[int, int], Workspace] = {}
        self._rendezvous = ExpertsRendezvous()
        #: groups of local experts under the ``sbo`` schedule (see the module docstring)
        self.sbo_groups = SBO_GROUPS
        #: SMs the experts' persistent kernels leave free while a group's combine is in flight
        #: under ``sbo`` (the experts of every group but the first, through
        #: :func:`dbo.ubatch.sm.experts_sm_carveout`, which :class:`dbo.experts.SwiGLUExperts`
        #: reads), so that a combine whose kernel needs SMs (DeepEP's low-latency one over
        #: NVLink) runs beside them; None leaves the run's or the experts' own setting
        self.sbo_sm_carveout: int | None = None

    def workspace(self) -> Workspace:
        """The running ubatch's scratch buffers (ubatch 0's outside a run)."""
        return self.workspaces.ubatch(dbo_current_ubatch_id())

    def _prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int, expert_map: torch.Tensor | None, router_on_input: bool,
                 beside: Callable[[], Any] | None = None) -> tuple[PrepareResult, Any]:
        """The dispatch's result, and ``beside()``'s, called while the dispatch is in flight
        (after an async backend's launch, before its receive; after a sync ``prepare``)."""
        pf = self.prepare_finalize
        # a hook another ubatch left for us must complete before we issue our own collectives
        dbo_maybe_run_recv_hook()
        if pf.supports_async():
            # a dispatch of copies on the compute stream would hold the shared experts behind it
            # (inside a run the backend moves its own work to the run's comm stream)
            side = (self._side_stream(a1) if beside is not None and pf.dispatch_holds_stream()
                    and not dbo_enabled() else None)
            compute = None if side is None else torch.cuda.current_stream()
            with dbo_region("dispatch"), ExitStack() as stack:
                if side is not None:
                    side.wait_stream(compute)
                    stack.enter_context(torch.cuda.stream(side))
                res = pf.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                       router_on_input, None)
            out = None if beside is None else beside()
            if side is not None:
                compute.wait_stream(side)  # before the receive reads what the copies wrote
            return _complete(res, "dispatch_recv"), out
        with dbo_region("dispatch"):
            prep = pf.prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                              router_on_input, None)
        return prep, None if beside is None else beside()

    def _side_stream(self, a1: torch.Tensor) -> Any:
        """The stream a stream-holding dispatch runs on under ``sbo`` (CUDA; None on the CPU)."""
        if not a1.is_cuda:
            return None
        if self._sbo_stream is None or self._sbo_stream.device != a1.device:
            self._sbo_stream = torch.cuda.Stream(a1.device)
        return self._sbo_stream

    def _shared(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with dbo_region("shared_experts"):
            return self.shared_experts(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        global_num_experts: int,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
    ) -> torch.Tensor:
        """Routed (plus shared) experts of this rank's tokens.

        Args:
            hidden_states: ``[M, hidden]`` bf16 or float32, this rank's (ubatch's) tokens.
            w1: ``[num_local_experts, 2 * intermediate, hidden]``, same dtype.
            w2: ``[num_local_experts, hidden, intermediate]``, same dtype.
            topk_weights: ``[M, topk]`` float32.
            topk_ids: ``[M, topk]`` int32/int64 global expert ids, ``-1`` for none.
            global_num_experts: experts over all ranks.
            expert_map: optional ``[global_num_experts]`` int32 global -> local id or ``-1``.
            apply_router_weight_on_input: multiply tokens by the (top-1) weight before the
                experts instead of weighting their outputs.

        Returns:
            ``[M, hidden]`` in ``hidden_states``'s dtype, a fresh tensor.
        """
        pf = self.prepare_finalize
        schedule = current_expert_schedule()
        in_run = dbo_enabled()
        sbo = schedule is ExpertSchedule.SBO
        if sbo and in_run:
            raise MoEProtocolError("the sbo expert schedule runs the batch unsplit, outside a ubatch "
                                   "run (it is a plan's schedule, not a ubatch's)")
        # sbo outside a run, sbo+dbo inside one (outside a run it is the plain layer, as split is)
        grouped = sbo or (schedule is ExpertSchedule.SBO_DBO and in_run)
        beside = (lambda: self._shared(hidden_states)) if grouped and self.shared_experts else None
        prep, shared_out = self._prepare(hidden_states, topk_weights, topk_ids, global_num_experts,
                                         expert_map, apply_router_weight_on_input, beside)
        ids = topk_ids if prep.topk_ids is None else prep.topk_ids
        weights = topk_weights if prep.topk_weights is None else prep.topk_weights
        inp = ExpertsInput(prep.a1q, prep.a1q_scale, prep.expert_tokens_meta, ids, weights)
        fmt = pf.activation_format
        self.experts.note_global_num_experts(global_num_experts)

        def apply(x: ExpertsInput, workspace: Workspace, w1: torch.Tensor = w1,
                  w2: torch.Tensor = w2) -> torch.Tensor:
            # quantized activations come with their scales; experts that take none never see any
            scale = {} if x.a1q_scale is None else {"a1q_scale": x.a1q_scale}
            return self.experts.apply(
                x.a1q, w1, w2, x.topk_weights, x.topk_ids,
                activation_format=fmt,
                expert_tokens_meta=x.expert_tokens_meta,
                apply_router_weight_on_input=apply_router_weight_on_input,
                workspace=workspace,
                **scale,
            )

        groups = (expert_groups(prep.a1q.shape[0], current_sbo_groups() or self.sbo_groups)
                  if grouped and fmt is ActivationFormat.BATCHED_EXPERTS and pf.supports_expert_groups()
                  else ())
        if len(groups) > 1:
            output = self._grouped_combines(inp, groups, apply, hidden_states, w1, w2, weights, ids,
                                            apply_router_weight_on_input)
            if shared_out is not None:
                output += shared_out
            return output
        if schedule is ExpertSchedule.MERGED and dbo_enabled() and dbo_num_ubatches() > 1:
            fused = self._rendezvous.run(
                inp, fmt, same_call_key(w1, w2, apply_router_weight_on_input),
                lambda merged: apply(merged, self.workspaces.merged),
                segmented=self.experts.accepts_batched_segments(inp.a1q))
        else:
            with dbo_region("experts"):
                fused = apply(inp, self.workspace())
        weight_and_reduce = self.experts.finalize_weight_and_reduce_impl()
        output = torch.empty_like(hidden_states)
        if sbo:  # the shared experts ran beside the dispatch
            with dbo_region("combine"):
                pf.finalize(output, fused, weights, ids, apply_router_weight_on_input,
                            weight_and_reduce)
        elif pf.supports_async():
            # As before prepare: a receive the other ubatch left for us must complete before
            # our launch (DeepEP's next low-latency launch reuses the buffer it reads from).
            dbo_maybe_run_recv_hook()
            with dbo_region("combine"):
                res = pf.finalize_async(output, fused, weights, ids, apply_router_weight_on_input,
                                        weight_and_reduce)
            if self.shared_experts is not None and beside is None:
                shared_out = self._shared(hidden_states)
            _complete(res, "combine_recv")
        else:
            with dbo_region("combine"):
                pf.finalize(output, fused, weights, ids, apply_router_weight_on_input,
                            weight_and_reduce)
            if self.shared_experts is not None and beside is None:
                shared_out = self._shared(hidden_states)
        if shared_out is not None:
            output += shared_out
        return output

    __call__ = forward

    def _beside_a_combine(self, active: bool):
        return experts_sm_carveout(self.sbo_sm_carveout if active else None)

    def _grouped_combines(self, inp: ExpertsInput, groups: list[tuple[int, int]],
                          apply: Callable[..., torch.Tensor],
                          hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                          weights: torch.Tensor, ids: torch.Tensor, router_on_input: bool) -> torch.Tensor:
        """The grouped schedules' routed experts on BATCHED_EXPERTS slabs, group by group, each
        group's combine launched once its experts are queued; returns the sum of the groups'
        outputs. Group ``g``'s receive is queued after group ``g + 1``'s experts, so the combine
        runs beside them, and before group ``g + 1``'s combine is launched (inside a run its
        hook goes to the other ubatch and this one yields there). The buffers are the running
        ubatch's own."""
        pf = self.prepare_finalize
        weight_and_reduce = self.experts.finalize_weight_and_reduce_impl()
        x, meta = inp.a1q, inp.expert_tokens_meta
        ub = dbo_current_ubatch_id()
        # every group's experts write into their rows of one layer-sized tensor, which each
        # group's combine reads (the rows of the other groups it does not send)
        full = self.workspace().get("sbo_out", tuple(x.shape), hidden_states.dtype, x.device)
        pending, total = None, None
        for gi, (g0, g1) in enumerate(groups):
            part = ExpertsInput(
                x[g0:g1], None if inp.a1q_scale is None else inp.a1q_scale[g0:g1],
                None if meta is None else ExpertTokensMetadata(
                    meta.expert_num_tokens[g0:g1],
                    None if meta.expert_num_tokens_cpu is None else meta.expert_num_tokens_cpu[g0:g1]),
                inp.topk_ids, inp.topk_weights)
            ws = self._group_workspaces.setdefault((ub, gi), Workspace())
            ws.bind("fused_out", full[g0:g1])
            with dbo_region(f"experts_group{gi}"), self._beside_a_combine(gi > 0):
                y = apply(part, ws, w1[g0:g1], w2[g0:g1])
                if y.data_ptr() != full[g0:g1].data_ptr():  # experts that keep their own buffer
                    full[g0:g1].copy_(y)
            if pending is not None:  # before the next launch (DeepEP low-latency needs it)
                total = self._add_group(pending, total)
            dbo_maybe_run_recv_hook()  # a receive the other ubatch left for us comes first
            out_g = torch.empty_like(hidden_states)
            with dbo_region(f"combine_group{gi}"):
                res = pf.finalize_group_async(out_g, full, weights, ids, router_on_input,
                                              weight_and_reduce, experts=(g0, g1),
                                              last=gi == len(groups) - 1)
            pending = (res, out_g)
        return self._add_group(pending, total)

    @staticmethod
    def _add_group(pending: tuple[Any, torch.Tensor], total: torch.Tensor | None) -> torch.Tensor:
        """Complete one group's combine (inside a run: its hook to the other ubatch, a yield) and
        add its output to ``total``."""
        res, out = pending
        _complete(res, "combine_recv")
        return out if total is None else total.add_(out)

    def reset(self) -> None:
        """Free the per-ubatch scratch buffers, any merged-schedule rendezvous in progress and
        the backend's per-ubatch state."""
        self.workspaces.clear()
        self._group_workspaces.clear()
        self._rendezvous.reset()
        self.prepare_finalize.reset()
