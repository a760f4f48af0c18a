"""The expert-parallel MoE block that replaces a model's own sparse MoE block.

:class:`ExpertParallelMoE` keeps the model's router module (so routing is the model's own:
scoring function, top-k, normalisation, bias, group limits, scaling) and its shared experts,
holds this rank's slice of the routed experts, and runs them through a :class:`dbo.moe.MoEKernel`
with an all-to-all backend, so under DBO the ubatches switch while its dispatch and combine are
in flight.

Rows that must reach no expert: a split forward's ubatch padding rows
(:func:`dbo.overlap.current_ubatch`) and, inside :func:`routing_token_mask`, the tokens that
an attention mask marks as padding. Their outputs are the shared experts' only (or zero);
callers drop them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dbo.backends import make_backend
from dbo.experts import SwiGLUExperts
from dbo.integrations.transformers.decode_phase import checked_decode_kwargs, decoding
from dbo.integrations.transformers.emulated import backend_group_options
from dbo.moe import MoEKernel, PrepareAndFinalize, WorkspacePool
from dbo.overlap import current_ubatch
from dbo.split import mask_padding_routing
from dbo.ubatch.context import dbo_region

__all__ = ["ExpertParallelMoE", "routing_token_mask", "current_routing_token_mask", "mask_routing"]

# Per forward (and per ubatch: each runs in its own copy of the caller's contextvars context).
_TOKEN_MASK: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "dbo_routing_token_mask", default=None)


@contextlib.contextmanager
def routing_token_mask(mask: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, tokens where ``mask`` is 0/False route to no expert.

    Args:
        mask: ``[batch, seq]`` (an attention mask: 1 real, 0 padding; any integer or bool
            dtype) for the forward run inside the block, or None (every token routes).
    """
    token = _TOKEN_MASK.set(None if mask is None else mask.reshape(-1).bool())
    try:
        yield
    finally:
        _TOKEN_MASK.reset(token)


def current_routing_token_mask() -> torch.Tensor | None:
    """The flattened ``bool[batch * seq]`` mask set by :func:`routing_token_mask`, or None."""
    return _TOKEN_MASK.get()


def mask_routing(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Route the rows that must reach no expert nowhere: a split forward's ubatch padding rows
    (:func:`dbo.overlap.current_ubatch`) and the tokens :func:`routing_token_mask` marks.

    Args:
        ids: ``[M, topk]`` integer global expert ids of this forward's (ubatch's) ``M`` tokens.
        weights: ``[M, topk]`` float32 router weights.

    Returns:
        ``(ids, weights)``: the same shapes and dtypes, ``-1`` / ``0`` in the masked rows.
    """
    rows = ids.shape[0]
    info = current_ubatch()
    if info is not None and info.num_valid < info.padded_size:
        # the split is over the forward's input rows (sequences); each holds rows // padded_size tokens
        if rows % info.padded_size:
            raise ValueError(f"the MoE block got {rows} tokens, not a multiple of the ubatch's "
                             f"{info.padded_size} input rows")
        ids, weights = mask_padding_routing(ids, weights, info.num_valid * (rows // info.padded_size))
    token_mask = _TOKEN_MASK.get()
    if token_mask is not None:
        if token_mask.shape[0] != rows:
            raise ValueError(f"routing_token_mask has {token_mask.shape[0]} tokens, the MoE block "
                             f"got {rows}")
        keep = token_mask.to(ids.device).unsqueeze(1)
        ids = torch.where(keep, ids, torch.full_like(ids, -1))
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    return ids, weights


class ExpertParallelMoE(torch.nn.Module):
    """A sparse MoE block whose routed experts are spread over an expert-parallel group.

    Args:
        router: the model's router module; ``router(x [M, hidden])`` returns
            ``(logits, topk_weights [M, topk], topk_ids [M, topk])``.
        w1: ``[num_local_experts, 2 * intermediate, hidden]``: this rank's fused gate/up
            projections (gate rows first), the model's dtype.
        w2: ``[num_local_experts, hidden, intermediate]``: this rank's down projections.
        backend: the prepare/finalize backend (one per block).
        num_experts: routed experts over the whole group.
        topk: experts per token (the router's).
        first_expert: the global id of this rank's first expert (experts are contiguous).
        shared_experts: optional module ``[M, hidden] -> [M, hidden]`` added to the output
            (run while the combine is in flight).
        family: a name for ``repr`` (the model family).
        group: the expert-parallel group the experts were sliced for (None: the default group;
            an :class:`~dbo.backends.emulated.EmulatedGroup`: one rank played alone), on which
            :meth:`switch_backend` builds its backends.

    Inside :func:`~dbo.integrations.transformers.decode_phase.decode_phase` the block runs its
    decode backend where :meth:`switch_backend` gave it one (DeepEP's low-latency kernels for the
    decode steps after a high-throughput prefill), else its backend.
    """

    def __init__(self, router: torch.nn.Module, w1: torch.Tensor, w2: torch.Tensor,
                 backend: PrepareAndFinalize, *, num_experts: int, first_expert: int, topk: int,
                 shared_experts: torch.nn.Module | None = None, family: str = "", group: Any = None):
        super().__init__()
        if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0]:
            raise ValueError(f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} must be "
                             "[num_local_experts, 2I, hidden] and [num_local_experts, hidden, I]")
        self.gate = router
        self.w1 = torch.nn.Parameter(w1, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)
        self.shared_experts = shared_experts
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.topk = topk
        self.family = family
        self.group = group
        self.decode_kernel: MoEKernel | None = None
        self.use_backend(backend)

    def switch_backend(self, name: str, *, group: Any = None, decode_backend: str | None = None,
                       decode_backend_kwargs: dict[str, Any] | None = None,
                       max_tokens_per_rank: int | None = None, **options: Any) -> None:
        """Run the routed experts through a new backend ``name`` (a key of
        :data:`dbo.backends.BACKENDS`) on ``group`` (None: the group the block was converted
        over), built now with ``options``: collective where the backend is. With
        ``decode_backend``, the calls made inside
        :func:`~dbo.integrations.transformers.decode_phase.decode_phase` go through that backend
        (built now with ``decode_backend_kwargs``; a backend sized by its tokens per call gets
        :data:`~dbo.integrations.transformers.decode_phase.DEEPEP_LL_MAX_TOKENS` unless told);
        without, through ``name`` too. The model-facing entry is
        :func:`dbo.integrations.transformers.use_backend`.

        Raises:
            ValueError: unknown backend or decode backend; a backend that cannot run over the
                group (:func:`~dbo.integrations.transformers.emulated.backend_group_options`).
        """
        group = self.group if group is None else group
        decode_kwargs = checked_decode_kwargs(decode_backend, decode_backend_kwargs)
        backend = self._make_backend(name, group, dict(options, max_tokens_per_rank=max_tokens_per_rank))
        decode = None if decode_backend is None else self._make_backend(decode_backend, group, decode_kwargs)
        self.use_backend(backend, decode_backend=decode)

    def _make_backend(self, name: str, group: Any, options: dict[str, Any]) -> PrepareAndFinalize:
        group, options = backend_group_options(name, group, options)
        return make_backend(name, group, hidden=self.w1.shape[2], num_experts=self.num_experts,
                            topk=self.topk, dtype=self.w1.dtype, device=self.w1.device, **options)

    def use_backend(self, backend: PrepareAndFinalize, *,
                    decode_backend: PrepareAndFinalize | None = None) -> None:
        """Run the routed experts through ``backend`` from now on (a fresh kernel), and inside
        :func:`~dbo.integrations.transformers.decode_phase.decode_phase` through
        ``decode_backend`` (None: ``backend`` there too)."""
        self.kernel, self.ids_dtype = self._kernel_of(backend)
        self.decode_kernel, self.decode_ids_dtype = (None, None) if decode_backend is None \
            else self._kernel_of(decode_backend)

    def _kernel_of(self, backend: PrepareAndFinalize) -> tuple[MoEKernel, torch.dtype]:
        shared: Callable[[torch.Tensor], torch.Tensor] | None = (
            None if self.shared_experts is None else self._shared)
        return (MoEKernel(backend, SwiGLUExperts(), shared_experts=shared,
                          workspaces=WorkspacePool.of_device(self.w1.device)),
                backend.topk_indices_dtype() or torch.int64)

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def expert_range(self) -> tuple[int, int]:
        """``(first, stop)`` global ids of the experts this rank holds."""
        return self.first_expert, self.first_expert + self.num_local_experts

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[..., hidden]`` (the model's dtype) -> same shape and dtype."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        kernel, ids_dtype = self.kernel, self.ids_dtype
        if self.decode_kernel is not None and decoding():
            kernel, ids_dtype = self.decode_kernel, self.decode_ids_dtype
        with dbo_region("router"):
            _, weights, ids = self.gate(x)
            ids, weights = mask_routing(ids.to(ids_dtype), weights.to(torch.float32))
        out = kernel(x, self.w1, self.w2, weights, ids, global_num_experts=self.num_experts)
        return out.view(shape)

    def reset(self) -> None:
        """Drop per-ubatch state in the kernels and backends (after a failed step)."""
        self.kernel.reset()
        if self.decode_kernel is not None:
            self.decode_kernel.reset()

    def extra_repr(self) -> str:
        lo, hi = self.expert_range
        return (f"family={self.family!r}, experts={lo}..{hi - 1} of {self.num_experts}, "
                f"backend={type(self.kernel.prepare_finalize).__name__}, "
                + (f"decode_backend={type(self.decode_kernel.prepare_finalize).__name__}, "
                   if self.decode_kernel is not None else "") +
                f"shared={self.shared_experts is not None}")
