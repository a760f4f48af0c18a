"""The experts that run in dbo's expert-parallel implementations, on a transformers experts module.

Two choices (:data:`EXPERTS_CHOICES`), both in both activation formats:

- :class:`LibraryExperts` (``"library"``): dbo's :class:`~dbo.experts.SwiGLUExperts` on the
  module's own weights, read where they lie: transformers' fused ``gate_up_proj``
  ``[E, 2I, hidden]`` (gate rows first) and ``down_proj`` ``[E, hidden, I]`` are already
  ``w1`` / ``w2`` (no copy). Slots whose expert is on another rank (id ``-1``) are skipped, not
  computed. Only for SiLU-gated experts in that layout (:func:`library_layout_problem` says why
  not otherwise).
- :class:`ModelExperts` (``"model"``): the module's own forward (whatever
  ``experts_implementation``), on this rank's local expert ids and transformers' sentinel for
  the slots whose expert is elsewhere.

``"auto"`` (:func:`make_experts`'s default) takes the library experts where the layout allows
and the module's own otherwise. Under FSDP2 the module's parameters are DTensors swapped around
each call; :func:`_local_params` swaps them where the experts read them, since under DBO one
call spans yields.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from dbo.errors import DBOError
from dbo.experts import SwiGLUExperts
from dbo.experts.swiglu import dequantize_blocks
from dbo.moe import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEExperts,
    TopKWeightAndReduce,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    Workspace,
)
from dbo.moe.validate import ACTIVATION_DTYPES

__all__ = ["EXPERTS_CHOICES", "UnsupportedEPError", "ModelExperts", "LibraryExperts",
           "library_layout_problem", "make_experts"]

logger = logging.getLogger(__name__)

#: which experts run on what a backend delivered: "library" (dbo's SwiGLUExperts on the
#: module's weights), "model" (the module's own forward), "auto" (library where supported)
EXPERTS_CHOICES = ("auto", "library", "model")

# the experts classes "auto" ran with their own forward, logged once each
_fallbacks_logged: set[str] = set()


class UnsupportedEPError(DBOError, ValueError):
    """transformers laid the experts out in a way dbo's implementations cannot run."""


@contextlib.contextmanager
def _local_params(module: torch.nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local tensors for the block (no yield inside).

    transformers swaps them around the whole implementation call, but under DBO that call spans
    yields: the ubatch that leaves first swaps the DTensors back while the other is still
    inside, so the experts swap them again right where they read them."""
    from torch.distributed.tensor import DTensor

    params = module._parameters
    originals = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    params.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        params.update(originals)


class ModelExperts(MoEExperts):
    """A transformers experts module's own forward as :class:`dbo.moe.MoEExperts`.

    The forward ``f(x [N, hidden], ids [N, k], weights [N, k]) -> [N, hidden]`` takes local
    expert ids, with ``num_local_experts`` for "no expert here" (transformers' sentinel), and
    weighs and sums over ``k`` itself. It reads the module's weights when it runs, so ``w1`` /
    ``w2`` of :meth:`apply` are ignored (placeholders). STANDARD format: one row per received token,
    reduced here. BATCHED_EXPERTS format (deepep_ll): each expert's slab becomes rows of that
    expert with weight 1, the rows past its count get the sentinel; finalize weighs them.

    Args:
        module: the experts module (``num_experts`` = its local expert count).
        forward: its forward (captured before transformers replaces ``module.forward``).
    """

    def __init__(self, module: torch.nn.Module, forward: Any):
        self.module = module
        self.forward = forward
        if hasattr(module, "_is_expert_parallel"):
            # the sentinel ids this class passes are masked by transformers' experts
            # implementations only in expert-parallel mode: grouped_mm leaves the sentinel rows of
            # its output unwritten otherwise, and weight 0 times an unwritten NaN is NaN
            module._is_expert_parallel = True
        self.num_local_experts = int(module.num_experts)
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        return TopKWeightAndReduceNoOp()

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        with _local_params(self.module):
            local = next(iter(self.module.parameters()), None)
            if local is not None and local.dim() == 3:
                _check_whole_experts(local.shape[0], self.num_local_experts)
            return self.forward(x, ids, weights).to(x.dtype)

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None,
              topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None, *,
              activation_format: ActivationFormat, expert_tokens_meta: ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool, workspace: Workspace,
              a1q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`dbo.moe.MoEExperts.apply` (``w1``/``w2`` unused)."""
        del w1, w2, workspace
        self._format = activation_format
        param = next(iter(self.module.parameters()), None)
        dtype = hidden_states.dtype if param is None or a1q_scale is None else param.dtype
        x = dequantize_blocks(hidden_states, a1q_scale, dtype)
        sentinel = self.num_local_experts
        if activation_format is ActivationFormat.BATCHED_EXPERTS:
            if expert_tokens_meta is None:
                raise ValueError("BATCHED_EXPERTS activations need expert_tokens_meta (rows per expert)")
            experts, rows, hidden = x.shape
            valid = (torch.arange(rows, device=x.device).unsqueeze(0)
                     < expert_tokens_meta.expert_num_tokens.to(x.device).unsqueeze(1))
            own = torch.arange(experts, device=x.device).unsqueeze(1).expand(experts, rows)
            ids = torch.where(valid, own, sentinel).reshape(-1, 1)
            out = self._run(x.reshape(-1, hidden), ids, valid.to(x.dtype).reshape(-1, 1))
            return out.view(experts, rows, hidden)
        if topk_ids is None or topk_weights is None:
            raise ValueError("STANDARD activations need topk_ids and topk_weights")
        mine = topk_ids >= 0
        ids = torch.where(mine, topk_ids, sentinel)
        weights = mine.to(x.dtype) if apply_router_weight_on_input else \
            torch.where(mine, topk_weights, 0.0).to(x.dtype)
        return self._run(x, ids, weights)


def _is_silu(act: Any) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover - transformers without it
        return False
    return isinstance(act, SiLUActivation)


def _default_gate(module: torch.nn.Module) -> bool:
    # transformers' use_experts_implementation puts _default_apply_gate (silu(gate) * up over
    # the two halves of gate_up) on the class unless the class brings its own
    fn = getattr(type(module), "_apply_gate", None)
    return fn is not None and getattr(fn, "__name__", "") == "_default_apply_gate" \
        and getattr(fn, "__module__", "") == "transformers.integrations.moe"


def library_layout_problem(module: torch.nn.Module) -> str | None:
    """Why dbo's library experts cannot run on ``module``'s own weights; None if they can.

    They can for an experts module that transformers' ``use_experts_implementation`` declares
    concatenated, not transposed, gated, without biases or a post-expert norm, whose only
    parameters are ``gate_up_proj`` ``[E, 2I, hidden]`` (gate rows first) and ``down_proj``
    ``[E, hidden, I]`` of a float dtype, with SiLU as ``act_fn`` and the default gate
    (``silu(gate) * up``): Qwen3-MoE's, Mixtral's and DeepSeek-V3's in transformers 5.x.
    """
    if not hasattr(module, "is_transposed"):
        return ("it does not declare its weight layout (transformers' use_experts_implementation "
                "sets is_transposed, is_concatenated, has_gate, has_bias)")
    if not getattr(module, "has_gate", True):
        return "it has no gate (an up projection only, not SwiGLU)"
    if module.is_transposed:
        return ("its weights are stored transposed (gate_up_proj [E, hidden, 2I], down_proj "
                "[E, I, hidden]); the library experts would copy them at every call")
    if not getattr(module, "is_concatenated", True):
        return "it interleaves the gate and up columns of gate_up_proj"
    if getattr(module, "has_bias", False):
        return "its projections have biases"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes each expert's output"
    names = {n for n, _ in module.named_parameters()}
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "it has no fused 3-D gate_up_proj and down_proj parameters"
    if names - {"gate_up_proj", "down_proj"}:
        return (f"it has parameters besides gate_up_proj and down_proj: "
                f"{', '.join(sorted(names - {'gate_up_proj', 'down_proj'}))}")
    e, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, hidden, two_i // 2):
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "[E, 2I, hidden] and [E, hidden, I]")
    if gate_up.dtype not in ACTIVATION_DTYPES or down.dtype != gate_up.dtype:
        return f"its weights are {gate_up.dtype}/{down.dtype}, not one of {ACTIVATION_DTYPES}"
    if not _default_gate(module):
        return f"it gates with its own {type(module).__name__}._apply_gate, not silu(gate) * up"
    if not _is_silu(getattr(module, "act_fn", None)):
        return (f"its activation is {type(getattr(module, 'act_fn', None)).__name__}, not silu "
                "(the library experts are SwiGLU)")
    return None


def _check_whole_experts(held: int, local: int) -> None:
    """The experts' weights on this rank must be its ``local`` experts, whole."""
    if held != local:
        raise UnsupportedEPError(
            f"the experts module holds {held} experts' weights on this rank, not its {local}: "
            "dbo's implementations need every expert whole on one rank (ep_size == fsdp_size * "
            "tp_size)")


def _refusal(module: torch.nn.Module, problem: str) -> str:
    return (f"dbo's library experts cannot run {type(module).__name__}: {problem}. They need "
            "SwiGLU experts with fused gate_up_proj [E, 2I, hidden] (gate rows first), down_proj "
            "[E, hidden, I], silu, no biases; use experts='model' (the module's own forward)")


class LibraryExperts(SwiGLUExperts):
    """dbo's :class:`~dbo.experts.SwiGLUExperts` on a transformers experts module's own weights.

    ``gate_up_proj`` ``[E, 2I, hidden]`` (gate rows first) and ``down_proj`` ``[E, hidden, I]``
    are ``w1`` and ``w2`` as they are (no copy); they are read when the experts run (the local
    tensors of FSDP's DTensors), so ``w1`` / ``w2`` of :meth:`apply` are ignored (placeholders).
    Slots whose expert is on another rank (id ``-1``) are skipped. Inference only: nothing is
    recorded for autograd (the backends' exchanges record nothing either). The output goes to a fresh
    buffer at every call, as the module's own forward does: the kernel's per-ubatch workspaces
    live as long as the layer, so one per layer would hold every layer's received rows at once.

    Args:
        module: the experts module (``num_experts`` = its local expert count).
        swiglu_kwargs: passed to :class:`~dbo.experts.SwiGLUExperts` (``reduce_in_experts`` stays True).

    Raises:
        UnsupportedEPError: the module's layout is not one the library experts run
            (:func:`library_layout_problem`).
    """

    def __init__(self, module: torch.nn.Module, **swiglu_kwargs: Any):
        problem = library_layout_problem(module)
        if problem is not None:
            raise UnsupportedEPError(_refusal(module, problem))
        if not swiglu_kwargs.pop("reduce_in_experts", True):
            raise ValueError("LibraryExperts reduce over top-k in the experts (reduce_in_experts=True)")
        super().__init__(**swiglu_kwargs)
        self.module = module
        self.num_local_experts = int(module.num_experts)

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None,
              topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None, *,
              activation_format: ActivationFormat, expert_tokens_meta: ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool, workspace: Workspace,
              a1q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`dbo.experts.SwiGLUExperts.apply` (``w1``/``w2``/``workspace`` unused)."""
        del w1, w2, workspace
        with _local_params(self.module):
            gate_up, down = self.module.gate_up_proj, self.module.down_proj
            _check_whole_experts(gate_up.shape[0], self.num_local_experts)
            # inference only, like the backends: no gradient reaches the weights (views, no copy)
            return super().apply(hidden_states.detach(), gate_up.detach(), down.detach(),
                                 topk_weights, topk_ids,
                                 activation_format=activation_format,
                                 expert_tokens_meta=expert_tokens_meta,
                                 apply_router_weight_on_input=apply_router_weight_on_input,
                                 workspace=Workspace(), a1q_scale=a1q_scale)


def make_experts(module: torch.nn.Module, forward: Any, choice: str = "auto") -> tuple[MoEExperts, str]:
    """The experts for ``module`` and which they are (``"library"`` or ``"model"``).

    Args:
        module: the experts module.
        forward: its own forward (for :class:`ModelExperts`).
        choice: ``"library"`` (:class:`LibraryExperts`, refused where the layout does not allow),
            ``"model"`` (:class:`ModelExperts`) or ``"auto"`` (the library experts where the
            layout allows, the module's own forward otherwise, logged once per class).

    Raises:
        ValueError: ``choice`` is not one of :data:`EXPERTS_CHOICES`.
        UnsupportedEPError: ``"library"`` for a module the library experts cannot run.
    """
    if choice not in EXPERTS_CHOICES:
        raise ValueError(f"experts must be one of {EXPERTS_CHOICES}, got {choice!r}")
    if choice == "model":
        return ModelExperts(module, forward), "model"
    problem = library_layout_problem(module)
    if problem is None:
        return LibraryExperts(module), "library"
    if choice == "library":
        raise UnsupportedEPError(_refusal(module, problem))
    name = type(module).__name__
    if name not in _fallbacks_logged:
        _fallbacks_logged.add(name)
        logger.warning("dbo: %s runs its own forward in dbo's expert-parallel implementations "
                       "(every received slot, non-local ones included): %s", name, problem)
    return ModelExperts(module, forward), "model"
