"""The MoE kernel: drives a prepare/finalize backend and the experts through the ubatch context.

Under DBO a backend's ``prepare_async``/``finalize_async`` may return ``(hook, receiver)``; the
kernel hands the hook to the ubatch context and yields, so another ubatch's compute runs while
the all-to-all is in flight, then calls the receiver. Shared experts run while the combine is
in flight. Without DBO the same code runs the hook in place.

With the ``merged`` expert schedule (:func:`dbo.expert_schedule.current_expert_schedule`, set
by the overlapped forward for its run) the routed experts of all ubatches run as one call after
every ubatch's dispatch (:mod:`dbo.moe.merged`); prepare and finalize stay per ubatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dbo.expert_schedule import ExpertSchedule, current_expert_schedule
from dbo.moe.base import (
    MoEExperts,
    PrepareAndFinalize,
    PrepareResult,
    Workspace,
)
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

__all__ = ["MoEKernel"]

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

    Scratch buffers are kept per ubatch (indexed by ``dbo_current_ubatch_id()``), so one kernel
    object serves every ubatch of a run. Under the ``merged`` expert schedule the kernel is
    also where its ubatches meet (:class:`dbo.moe.merged.ExpertsRendezvous`); the merged call
    has scratch buffers of its own.
    """

    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: MoEExperts,
                 shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None):
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
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts
        self._workspaces: list[Workspace] = []
        self._merged_workspace = Workspace()
        self._rendezvous = ExpertsRendezvous()

    def workspace(self) -> Workspace:
        """The running ubatch's scratch buffers (ubatch 0's outside a run)."""
        ub = dbo_current_ubatch_id()
        while len(self._workspaces) <= ub:
            self._workspaces.append(Workspace())
        return self._workspaces[ub]

    def _prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int, expert_map: torch.Tensor | None, router_on_input: bool) -> PrepareResult:
        pf = self.prepare_finalize
        # a hook another ubatch left for us must complete before we issue our own collectives
        dbo_maybe_run_recv_hook()
        if pf.supports_async():
            with dbo_region("dispatch"):
                res = pf.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                       router_on_input, None)
            return _complete(res, "dispatch_recv")
        with dbo_region("dispatch"):
            return pf.prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                              router_on_input, None)

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
        prep = self._prepare(hidden_states, topk_weights, topk_ids, global_num_experts,
                             expert_map, apply_router_weight_on_input)
        ids = topk_ids if prep.topk_ids is None else prep.topk_ids
        weights = topk_weights if prep.topk_weights is None else prep.topk_weights
        inp = ExpertsInput(prep.a1q, prep.a1q_scale, prep.expert_tokens_meta, ids, weights)
        fmt = pf.activation_format
        self.experts.note_global_num_experts(global_num_experts)

        def apply(x: ExpertsInput, workspace: Workspace) -> torch.Tensor:
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

        if (current_expert_schedule() is ExpertSchedule.MERGED and dbo_enabled()
                and dbo_num_ubatches() > 1):
            fused = self._rendezvous.run(
                inp, fmt, same_call_key(w1, w2, apply_router_weight_on_input),
                lambda merged: apply(merged, self._merged_workspace))
        else:
            with dbo_region("experts"):
                fused = apply(inp, self.workspace())
        weight_and_reduce = self.experts.finalize_weight_and_reduce_impl()
        output = torch.empty_like(hidden_states)
        shared_out = None
        if pf.supports_async():
            # As before prepare: a receive the other ubatch left for us must complete before
            # our launch (DeepEP's next low-latency launch reuses the buffer it reads from).
            dbo_maybe_run_recv_hook()
            with dbo_region("combine"):
                res = pf.finalize_async(output, fused, weights, ids, apply_router_weight_on_input,
                                        weight_and_reduce)
            if self.shared_experts is not None:
                with dbo_region("shared_experts"):
                    shared_out = self.shared_experts(hidden_states)
            _complete(res, "combine_recv")
        else:
            with dbo_region("combine"):
                pf.finalize(output, fused, weights, ids, apply_router_weight_on_input,
                            weight_and_reduce)
            if self.shared_experts is not None:
                with dbo_region("shared_experts"):
                    shared_out = self.shared_experts(hidden_states)
        if shared_out is not None:
            output += shared_out
        return output

    __call__ = forward

    def reset(self) -> None:
        """Free the per-ubatch scratch buffers, any merged-schedule rendezvous in progress and
        the backend's per-ubatch state."""
        self._workspaces.clear()
        self._merged_workspace.clear()
        self._rendezvous.reset()
        self.prepare_finalize.reset()
