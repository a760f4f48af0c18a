"""Reference SwiGLU experts for both activation formats.

``y = w2 @ (silu(g) * u)`` with ``[g; u] = w1 @ x``. On CUDA with bf16 and ``torch._grouped_mm``
available, STANDARD format sorts the (token, expert) pairs by expert and runs two grouped
matmuls; BATCHED_EXPERTS uses two batched matmuls. Elsewhere (CPU, fp32) a plain loop over the
experts that received tokens.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from dbo.moe.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    MoEExperts,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    Workspace,
)
from dbo.moe.validate import check_expert_weights

__all__ = ["SwiGLUExperts", "swiglu_expert"]

logger = logging.getLogger(__name__)

_grouped_mm = getattr(torch, "_grouped_mm", None)


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``x`` ``[N, hidden]``, ``w1`` ``[2I, hidden]``, ``w2`` ``[hidden, I]`` ->
    ``[N, hidden]`` in ``x``'s dtype."""
    h = x @ w1.t()
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


class SwiGLUExperts(MoEExperts):
    """SwiGLU experts on local expert weights.

    Args:
        reduce_in_experts: in STANDARD format, weight by ``topk_weights`` and sum over top-k
            here (output ``[M, hidden]``, finalize does nothing more); if False return
            ``[M, topk, hidden]`` unweighted and leave it to TopKWeightAndReduceContiguous.
        use_grouped_mm: use ``torch._grouped_mm`` when on CUDA with bf16 (default: when
            available).
    """

    def __init__(self, *, reduce_in_experts: bool = True, use_grouped_mm: bool | None = None):
        self.reduce_in_experts = reduce_in_experts
        self.use_grouped_mm = _grouped_mm is not None if use_grouped_mm is None else use_grouped_mm
        self._format: ActivationFormat | None = None

    def supported_activation_formats(self) -> tuple[ActivationFormat, ...]:
        return (ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        if self._format is ActivationFormat.BATCHED_EXPERTS:
            return TopKWeightAndReduceDelegate()
        if self.reduce_in_experts:
            return TopKWeightAndReduceNoOp()
        return TopKWeightAndReduceContiguous()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, *, activation_format,
              expert_tokens_meta, apply_router_weight_on_input, workspace):
        self._format = activation_format
        if activation_format is ActivationFormat.BATCHED_EXPERTS:
            return self._apply_batched(hidden_states, w1, w2, expert_tokens_meta, workspace)
        return self._apply_standard(hidden_states, w1, w2, topk_weights, topk_ids,
                                    apply_router_weight_on_input, workspace)

    # ---- STANDARD -------------------------------------------------------------------------

    def _apply_standard(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        router_on_input: bool, workspace: Workspace) -> torch.Tensor:
        m, hidden = x.shape
        n_local = check_expert_weights(w1, w2, hidden, x.dtype)
        topk = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).to(torch.int64)
        # (token, slot) pairs routed to a local expert, grouped by expert
        pairs = torch.nonzero(flat_ids >= 0).squeeze(1)
        order = torch.argsort(flat_ids[pairs], stable=True)
        pairs = pairs[order]
        experts = flat_ids[pairs]
        tokens = pairs // topk
        counts = torch.bincount(experts, minlength=n_local)
        xs = x[tokens]
        ys = None
        if (x.is_cuda and x.dtype == torch.bfloat16 and self.use_grouped_mm
                and _grouped_mm is not None and pairs.numel() and hidden % 8 == 0
                and w2.shape[2] % 8 == 0):
            ys = self._grouped(xs, w1, w2, counts)
        if ys is None:
            ys = torch.empty_like(xs)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    ys[start:start + c] = swiglu_expert(xs[start:start + c], w1[e], w2[e])
                    start += c
        if not self.reduce_in_experts:
            out = workspace.get("fused_out", (m, topk, hidden), x.dtype, x.device)
            out.zero_()
            out.view(m * topk, hidden)[pairs] = ys
            return out
        yf = ys.to(torch.float32)
        if not router_on_input:
            yf = yf * topk_weights.reshape(-1)[pairs].unsqueeze(1)
        acc = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
        acc.index_add_(0, tokens, yf)
        out = workspace.get("fused_out", (m, hidden), x.dtype, x.device)
        out.copy_(acc)
        return out

    def _grouped(self, xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor | None:
        """Two grouped matmuls over the expert-sorted rows; None if this torch/GPU refuses."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        try:
            h = _grouped_mm(xs, w1.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            return _grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
        except RuntimeError as exc:
            logger.warning("torch._grouped_mm failed (%s); falling back to a loop over experts", exc)
            self.use_grouped_mm = False
            return None

    # ---- BATCHED_EXPERTS ------------------------------------------------------------------

    def _apply_batched(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       meta: ExpertTokensMetadata | None, workspace: Workspace) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"BATCHED_EXPERTS activations must be [num_local_experts, max_tokens, "
                             f"hidden], got shape {tuple(x.shape)}")
        if meta is None:
            raise ValueError("BATCHED_EXPERTS format needs expert_tokens_meta")
        n_local, max_tokens, hidden = x.shape
        check_expert_weights(w1, w2, hidden, x.dtype, n_local)
        out = workspace.get("fused_out", (n_local, max_tokens, hidden), x.dtype, x.device)
        if x.is_cuda:
            # padded rows compute garbage, which finalize ignores; two launches beat a loop
            h = torch.bmm(x, w1.transpose(1, 2))
            gate, up = h.chunk(2, dim=-1)
            torch.bmm(F.silu(gate) * up, w2.transpose(1, 2), out=out)
            return out
        counts = meta.expert_num_tokens_cpu
        if counts is None:
            counts = meta.expert_num_tokens.cpu()
        for e, c in enumerate(counts.tolist()):
            if c > max_tokens:
                raise ValueError(f"expert_tokens_meta says expert {e} has {c} tokens, more than "
                                 f"max_tokens={max_tokens}")
            if c:
                out[e, :c] = swiglu_expert(x[e, :c], w1[e], w2[e])
        return out
