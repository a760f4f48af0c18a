"""The benchmarks' backends, by name: one registry, one factory, and the process-group teardown.

To add a backend to ``python -m dbo.bench overlap --backend NAME`` (and to the demo), add one
entry to :data:`BACKENDS`: the module under ``dbo.backends`` and how to build it. A module that
follows the DeepEP backends' convention (a ``make_prepare_finalize(group, *, hidden,
max_tokens_per_rank, num_experts, topk, dtype, device)`` function, as the copy-engine backend
``dbo.backends.copy_engine`` will) needs no more than ``"name": ("module", None)``; a
torch.distributed backend built as ``Class(group, hidden_size=hidden)`` names its class.
"""

from __future__ import annotations

import gc
import importlib
from typing import Any

import torch
import torch.distributed as dist

from dbo.moe import PrepareAndFinalize

__all__ = ["BACKENDS", "make_backend", "shutdown_distributed"]

#: backend name -> (module under dbo.backends, class built as ``cls(group, hidden_size=...)`` or
#: None for the module's ``make_prepare_finalize``); modules are imported only when chosen.
#: Add new backends here (e.g. "copy_engine": ("copy_engine", None)).
BACKENDS: dict[str, tuple[str, str | None]] = {
    "naive": ("naive", "NaivePrepareAndFinalize"),
    "all2all": ("all2all", "AllToAllPrepareAndFinalize"),
    "deepep_ht": ("deepep_ht", None),
    "deepep_ll": ("deepep_ll", None),
    "deepep_v2": ("deepep_v2", None),
}


def make_backend(name: str, group: Any, *, hidden: int, num_experts: int, topk: int,
                 max_tokens_per_rank: int, dtype: torch.dtype,
                 device: torch.device) -> PrepareAndFinalize:
    """Build the prepare/finalize backend ``name`` (a key of :data:`BACKENDS`) on ``group``.

    The backend module is imported here, so DeepEP is needed only when a DeepEP backend is
    chosen. ``group`` None is the default (world) group. ``max_tokens_per_rank``: the most
    tokens any rank sends in one call (sizes the low-latency buffers).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    if group is None:
        group = torch.distributed.group.WORLD  # DeepEP's Buffer needs the group object itself
    module_name, cls = BACKENDS[name]
    module = importlib.import_module(f"dbo.backends.{module_name}")
    if cls is not None:
        return getattr(module, cls)(group, hidden_size=hidden)
    return module.make_prepare_finalize(group, hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
                                        num_experts=num_experts, topk=topk, dtype=dtype, device=device)


def shutdown_distributed(*, wait_for_peers: bool) -> None:
    """Destroy the default process group once nothing on this rank still uses it.

    Collects garbage first, so that backends and the async collective work they hold die
    before the group does, then (``wait_for_peers``, on the success path only: a failed peer
    would make it wait for the group's timeout) a barrier, so that no rank tears its gloo pairs
    down while another is still using them. Without both, about one CPU run in ten died at
    exit with ``terminate called without an active exception`` (SIGABRT) after printing its
    results.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    if wait_for_peers:
        dist.barrier()
    dist.destroy_process_group()
