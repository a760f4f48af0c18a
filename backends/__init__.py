"""Prepare/finalize backends by name: one entry per all-to-all library.

:data:`BACKENDS` maps a name to a :class:`BackendSpec` that says which ``dbo.backends`` module
builds it and whether it needs GPUs. Every backend is built one way: its module's
``make_prepare_finalize(group, *, hidden, max_tokens_per_rank, num_experts, topk, dtype,
device, **options)``, called by :func:`make_backend`. The module is imported only when its
backend is built, so ``deep_ep`` is needed only for a DeepEP backend. A new backend is a module
with that function and one entry here.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from dbo.moe.base import PrepareAndFinalize

__all__ = ["BackendSpec", "BACKENDS", "FACTORY_ARGS", "TRAFFIC", "backend_spec", "backend_options",
           "make_backend", "cpu_backends", "describe_backend"]

#: the keyword arguments every ``make_prepare_finalize`` takes, besides ``group`` and options
FACTORY_ARGS = ("hidden", "max_tokens_per_rank", "num_experts", "topk", "dtype", "device")

#: the ways a backend's activations move between ranks (:attr:`BackendSpec.traffic`)
TRAFFIC = ("per_rank", "per_expert", "to_every_rank", "gather")


@dataclass(frozen=True)
class BackendSpec:
    """How to build one backend.

    Attributes:
        name: the name users pass (``backend="all2all"``).
        module: the module under ``dbo.backends`` that implements it; it offers
            ``make_prepare_finalize(group, *, hidden, max_tokens_per_rank, num_experts, topk,
            dtype, device, **options)`` (:data:`FACTORY_ARGS`).
        gpu_only: needs CUDA (and, for DeepEP, ``deep_ep``).
        bf16_only: moves bf16 activations only.
        needs_max_tokens: sizes its buffers by ``max_tokens_per_rank``, a hard limit per call
            (deepep_ll: DeepEP's low-latency buffers are fixed; deepep_v2 likewise).
        serves_link: takes ``link`` itself (its flows are the bytes it counts on the device)
            instead of being wrapped by :class:`~dbo.backends.simulated_link.SimulatedLinkPrepareAndFinalize`.
        emulated: plays one rank of a larger group on this process alone: no peers, its group
            size is ``num_dispatchers()``, not the process group's.
        single_rank: runs on a group of one rank only (every expert on this process, nothing
            moves); :func:`cpu_backends` leaves it out.
        slot_per_ubatch: keeps a buffer slot per ubatch id, so it is built for a number of
            ubatches (:func:`make_backend`'s ``num_ubatches``) and refuses a run with more.
        run_on_gpus: has run on GPUs; False for a backend only tested against its library's
            documented API (``deepep_v2``), which :func:`describe_backend` says wherever
            backends are listed.
        uses_deep_ep: built on DeepEP's buffers (needs ``deep_ep``; on the CPU only on
            :mod:`dbo.testing.fake_deep_ep`, which stands in for it).
        low_latency: DeepEP's low-latency kind, made for decode: a fixed buffer of
            ``max_tokens_per_rank`` per call, the BATCHED_EXPERTS layout, a receive hook in
            place of a stream switch (the benchmarks size and run its shapes as decode steps).
        sets_num_sms: its kernels run on a number of SMs fixed when its buffer is made
            (DeepEP's normal mode, ``Buffer.set_num_sms``), a number the benchmarks sweep.
        graph_capturable: nothing in its dispatch or combine waits for the GPU on the host, so
            a whole step can be captured in a CUDA graph (deepep_ht reads its receive counts).
        traffic: how its activations move between ranks, one of :data:`TRAFFIC` (the bytes
            per layer the benchmarks count, ``dbo.bench.overlap.link.comm_bytes``): ``"per_rank"``
            one copy of a token per remote rank that holds one of its experts, there and back;
            ``"per_expert"`` one copy per remote expert; ``"to_every_rank"`` every token and its
            routing row to every peer, a partial sum back to its owner; ``"gather"`` an
            all-gather and a reduce-scatter of every token. None: not counted that way (one
            rank, or a backend that counts its own bytes).
    """

    name: str
    module: str
    gpu_only: bool = False
    bf16_only: bool = False
    needs_max_tokens: bool = False
    serves_link: bool = False
    emulated: bool = False
    run_on_gpus: bool = True
    single_rank: bool = False
    slot_per_ubatch: bool = False
    uses_deep_ep: bool = False
    low_latency: bool = False
    sets_num_sms: bool = False
    graph_capturable: bool = False
    traffic: str | None = None

    def __post_init__(self) -> None:
        if self.traffic is not None and self.traffic not in TRAFFIC:
            raise ValueError(f"traffic must be one of {TRAFFIC} or None, got {self.traffic!r}")


BACKENDS: Mapping[str, BackendSpec] = MappingProxyType({
    "naive": BackendSpec("naive", "naive", traffic="gather"),
    "all2all": BackendSpec("all2all", "all2all", traffic="per_rank"),
    "deepep_ht": BackendSpec("deepep_ht", "deepep_ht", gpu_only=True, bf16_only=True,
                             uses_deep_ep=True, sets_num_sms=True, traffic="per_rank"),
    "deepep_ll": BackendSpec("deepep_ll", "deepep_ll", gpu_only=True, bf16_only=True,
                             needs_max_tokens=True, uses_deep_ep=True, low_latency=True,
                             graph_capturable=True, traffic="per_expert"),
    "deepep_v2": BackendSpec("deepep_v2", "deepep_v2", gpu_only=True, bf16_only=True,
                             needs_max_tokens=True, run_on_gpus=False, uses_deep_ep=True,
                             traffic="per_rank"),
    # zero-SM copy-engine puts on one host (host shared memory on CPU); its buffers size themselves
    "copy_engine": BackendSpec("copy_engine", "copy_engine", slot_per_ubatch=True,
                               graph_capturable=True, traffic="to_every_rank"),
    # one device as rank r of an N-rank group (dbo.backends.emulated), on CPU or one GPU
    "emulated": BackendSpec("emulated", "emulated", bf16_only=True, needs_max_tokens=True,
                            serves_link=True, emulated=True),
    # no expert parallelism: every expert on this process, a group of one rank (either format)
    "local": BackendSpec("local", "local", single_rank=True),
})


def backend_spec(name: str, *, what: str = "backend") -> BackendSpec:
    """The :class:`BackendSpec` of ``name``: the one check of a backend name (``what`` names the
    argument in the message, e.g. ``"decode_backend"``).

    Raises:
        ValueError: ``name`` is not a key of :data:`BACKENDS` (the message lists them).
    """
    spec = BACKENDS.get(name) if isinstance(name, str) else None
    if spec is None:
        listed = ", ".join(describe_backend(n) for n in sorted(BACKENDS))
        raise ValueError(f"unknown {what} {name!r}; choose from {listed}")
    return spec


def describe_backend(name: str) -> str:
    """``name``, with ``" (not yet run on GPUs)"`` for a backend only tested against its
    library's documented API (``deepep_v2``)."""
    return name if backend_spec(name).run_on_gpus else f"{name} (not yet run on GPUs)"


def cpu_backends() -> list[str]:
    """Names of the backends that run on CPU (gloo) over a group of ranks (not the single-rank
    ``local``, nor ``emulated``, which plays one rank of a group alone)."""
    return sorted(name for name, spec in BACKENDS.items()
                  if not spec.gpu_only and not spec.single_rank and not spec.emulated)


def _factory(name: str) -> Callable[..., PrepareAndFinalize]:
    spec = backend_spec(name)
    return importlib.import_module(f"dbo.backends.{spec.module}").make_prepare_finalize


def backend_options(name: str) -> list[str] | None:
    """The options backend ``name`` takes beyond :data:`FACTORY_ARGS` (keyword arguments of its
    ``make_prepare_finalize``), or None where it passes unnamed options on (``**kwargs``).

    Raises:
        ValueError: unknown name.
    """
    params = inspect.signature(_factory(name)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return sorted(p.name for p in params
                  if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in FACTORY_ARGS)


def make_backend(name: str, group: Any, *, hidden: int, num_experts: int, topk: int,
                 dtype: torch.dtype, device: torch.device | str,
                 max_tokens_per_rank: int | None = None, num_ubatches: int = 2, link: Any = None,
                 **kwargs: Any) -> PrepareAndFinalize:
    """Build backend ``name`` on ``group`` (None: the default group).

    Args:
        name: a key of :data:`BACKENDS`.
        hidden: activation width; dtype: activation dtype; device: where the tokens live.
        num_experts, topk: routing shape over the whole group.
        max_tokens_per_rank: the most tokens any rank sends in one call (needed by the
            backends with ``needs_max_tokens``; copy_engine allocates that much ahead and grows
            past it; ignored by the others).
        num_ubatches: the most ubatches one run cuts a batch into; a backend with
            ``slot_per_ubatch`` (copy_engine) is built with that many slots, the others take
            any number.
        link: a :class:`dbo.backends.simulated_link.SimulatedLink`: the backend's arrivals held
            back to a slower link's time (the bytes still move through the backend).
        kwargs: backend-specific options (:func:`backend_options`), passed on unchanged.

    Raises:
        ValueError: unknown name or option, or a backend that needs ``max_tokens_per_rank``
            without it.
        TypeError: a bf16-only backend with another dtype.
    """
    spec = backend_spec(name)
    if spec.bf16_only and dtype != torch.bfloat16:
        raise TypeError(f"backend {name!r} moves bf16 activations only; the model is {dtype} "
                        "(convert it with model.to(torch.bfloat16) first)")
    if link is not None and spec.serves_link:
        kwargs["link"] = link
    elif link is not None:
        from dbo.backends.simulated_link import SimulatedLink, SimulatedLinkPrepareAndFinalize

        if not isinstance(link, SimulatedLink):
            raise TypeError(f"link must be a SimulatedLink, got {type(link).__name__}")
        inner = make_backend(name, group, hidden=hidden, num_experts=num_experts, topk=topk, dtype=dtype,
                             device=device, max_tokens_per_rank=max_tokens_per_rank,
                             num_ubatches=num_ubatches, **kwargs)
        return SimulatedLinkPrepareAndFinalize(inner, link, name)
    options = backend_options(name)
    unknown = sorted(set(kwargs) - set(options)) if options is not None else []
    if unknown:
        raise ValueError(f"backend {name!r} has no option {unknown[0]!r}; its options: "
                         f"{', '.join(options) or 'none'}")
    if spec.needs_max_tokens and max_tokens_per_rank is None:
        raise ValueError(f"backend {name!r} needs max_tokens_per_rank (the most tokens a rank "
                         "sends in one MoE call: batch * seq of one ubatch)")
    if group is None:
        group = torch.distributed.group.WORLD  # DeepEP's Buffer needs the group object itself
    if spec.slot_per_ubatch:
        kwargs["num_ubatches"] = num_ubatches
    return _factory(name)(group, hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
                          num_experts=num_experts, topk=topk, dtype=dtype, device=device, **kwargs)
