"""The benchmarks' backends by name, and the process-group teardown.

The registry is :data:`dbo.integrations.backends.BACKENDS` (re-exported here with
:func:`~dbo.integrations.backends.make_backend`): one place for every user of backend names, so a
new backend (e.g. the copy-engine one, ``dbo.backends.copy_engine``) is one ``BackendSpec`` entry
there and ``python -m dbo.bench overlap --backend NAME`` offers it at once.
"""

from __future__ import annotations

import gc

import torch.distributed as dist

from dbo.integrations.backends import BACKENDS, make_backend

__all__ = ["BACKENDS", "make_backend", "shutdown_distributed"]


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
