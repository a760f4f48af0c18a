"""The cases :mod:`dbo.bench.experts.command` times: one rank's expert inputs as a backend delivers them,
in the STANDARD layout (:class:`ExpertsCase`: received tokens, top-k ids with ``-1`` for other
ranks' experts) or DeepEP low-latency's BATCHED_EXPERTS slabs (:class:`BatchedCase`: ``[local
experts, capacity, hidden]``, counts on the device), each with the call that runs experts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dbo.moe import ActivationFormat, ExpertTokensMetadata, MoEExperts, Workspace

__all__ = ["ExpertsCase", "BatchedCase", "make_case", "make_batched_case"]


@dataclass
class ExpertsCase:
    """One rank's expert inputs. ``x`` ``[tokens, hidden]``; ``w1`` ``[L, 2I, hidden]``; ``w2``
    ``[L, hidden, I]``; ``weights``/``ids`` ``[tokens, topk]`` (ids local, ``-1`` elsewhere);
    ``counts`` ``[L]`` int32 on the CPU."""

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    #: the counts as a backend hands them over, built once: building them per call would copy
    #: pageable host memory to the GPU, a host sync that makes the timing launch-bound
    _meta: ExpertTokensMetadata | None = None

    def meta(self, host_counts: bool) -> ExpertTokensMetadata | None:
        """With host counts: what DeepEP normal mode hands over; else None (device offsets)."""
        if not host_counts:
            return None
        if self._meta is None:
            self._meta = ExpertTokensMetadata(self.counts.to(self.x.device), self.counts)
        return self._meta

    def apply(self, experts: MoEExperts, host_counts: bool, ws: Workspace) -> torch.Tensor:
        """One STANDARD-format call of ``experts`` on the tokens and routing; ``[M, hidden]``."""
        return experts.apply(self.x, self.w1, self.w2, self.weights, self.ids,
                             activation_format=ActivationFormat.STANDARD,
                             expert_tokens_meta=self.meta(host_counts),
                             apply_router_weight_on_input=False, workspace=ws)

    def arrived(self, out: torch.Tensor) -> torch.Tensor:
        """The rows of an output that implementations must agree on: all of them."""
        return out

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


@dataclass
class BatchedCase:
    """One rank's expert inputs in the BATCHED_EXPERTS layout (DeepEP low-latency's): ``x``
    ``[L, capacity, hidden]``, expert ``e``'s rows the first ``counts[e]`` of ``x[e]`` (zeros
    past them); ``counts`` ``[L]`` int32 on the device and (``counts_cpu``) on the CPU; ``ids``
    ``[tokens, topk]`` this rank's own tokens' top-k ids (what the experts' estimate of rows per
    expert reads); ``w1``/``w2`` as in :class:`ExpertsCase`."""

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    counts_cpu: torch.Tensor

    def apply(self, experts: MoEExperts, host_counts: bool, ws: Workspace) -> torch.Tensor:
        """One BATCHED_EXPERTS call of ``experts`` (the counts on the host too when
        ``host_counts``); ``[L, capacity, hidden]``, valid on the rows that arrived."""
        meta = ExpertTokensMetadata(self.counts, self.counts_cpu if host_counts else None)
        return experts.apply(self.x, self.w1, self.w2, None, self.ids,
                             activation_format=ActivationFormat.BATCHED_EXPERTS,
                             expert_tokens_meta=meta, apply_router_weight_on_input=False, workspace=ws)

    def arrived(self, out: torch.Tensor) -> torch.Tensor:
        """The rows that arrived, expert after expert: ``[sum(counts), hidden]``."""
        return torch.cat([out[e, :c] for e, c in enumerate(self.counts_cpu.tolist())])

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]


def make_case(tokens: int, hidden: int, inter: int, local_experts: int, *, num_experts: int = 256,
              topk: int = 8, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
              seed: int = 0, weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> ExpertsCase:
    """A random case (uniform top-k routing); ``weights`` reuses ``(w1, w2)`` of the right shape."""
    g = torch.Generator(device=device).manual_seed(seed)
    if weights is None:
        weights = _random_weights(local_experts, hidden, inter, dtype, device, g)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    logits = torch.randn(tokens, num_experts, device=device, generator=g)
    topw, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    ids = torch.where(ids < local_experts, ids, -1).to(torch.int32)  # this rank holds [0, L)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=local_experts).to(torch.int32).cpu()
    return ExpertsCase(x, weights[0], weights[1], topw.float(), ids, counts)


def make_batched_case(tokens: int, hidden: int, inter: int, local_experts: int, *, ranks: int = 2,
                      topk: int = 8, dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | str = "cuda", seed: int = 0,
                      weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> BatchedCase:
    """A random low-latency case: ``ranks`` ranks each route ``tokens`` tokens uniformly to
    ``topk`` of ``local_experts * ranks`` experts; this rank holds the first ``local_experts``
    and receives every pair routed to them into slabs of ``tokens * ranks`` rows each (room for
    every token of every rank, as DeepEP low-latency sizes them). ``weights`` reuses ``(w1, w2)``."""
    if ranks < 1 or topk > local_experts * ranks:
        raise ValueError(f"need ranks >= 1 and topk <= local_experts * ranks, got ranks={ranks}, "
                         f"topk={topk}, local_experts={local_experts}")
    g = torch.Generator(device=device).manual_seed(seed)
    if weights is None:
        weights = _random_weights(local_experts, hidden, inter, dtype, device, g)
    n_global = local_experts * ranks
    ids = torch.rand(tokens * ranks, n_global, device=device, generator=g).topk(topk, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=n_global)[:local_experts].to(torch.int32)
    x = torch.zeros(local_experts, tokens * ranks, hidden, device=device, dtype=dtype)
    counts_cpu = counts.cpu()
    for e, c in enumerate(counts_cpu.tolist()):
        x[e, :c] = torch.randn(c, hidden, device=device, dtype=dtype, generator=g)
    own = ids[:tokens]
    own = torch.where(own < local_experts, own, -1).to(torch.int32)
    return BatchedCase(x, weights[0], weights[1], own, counts, counts_cpu)


def _random_weights(local_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                    device: torch.device | str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w1 = torch.randn(local_experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g)
    w2 = torch.randn(local_experts, hidden, inter, device=device, dtype=dtype, generator=g)
    return w1.mul_(hidden ** -0.5), w2.mul_(inter ** -0.5)
