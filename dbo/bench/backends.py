"""The benchmarks' backends by name, and the process-group teardown.

The registry is :data:`dbo.integrations.backends.BACKENDS` (re-exported here with
:func:`~dbo.integrations.backends.make_backend`): one place for every user of backend names, so a
new backend (e.g. the copy-engine one, ``dbo.backends.copy_engine``) is one ``BackendSpec`` entry
there and ``python -m dbo.bench overlap --backend NAME`` offers it at once.
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from dbo.integrations.backends import BACKENDS, make_backend
from dbo.watchdog import teardown_deadline

__all__ = ["BACKENDS", "make_backend", "shutdown_distributed"]


def shutdown_distributed(*, wait_for_peers: bool, deadline_s: float = 120.0) -> None:
    """Free DeepEP's buffers, then destroy the default process group once nothing on this rank
    still uses it.

    DeepEP's buffers (where this process made any) go first, while the group they were made on is
    alive (collective). Then it collects garbage, so that backends and the async collective work
    they hold die before the group does, then (``wait_for_peers``, on the success path only: a
    failed peer would make it wait for the group's timeout) a barrier, so that no rank tears its
    gloo pairs down while another is still using them. Without both, about one CPU run in ten died
    at exit with ``terminate called without an active exception`` (SIGABRT) after printing its
    results. The whole teardown waits on the peers and cannot be interrupted, so it runs under
    :func:`dbo.watchdog.teardown_deadline` (``deadline_s``): call it once the results are written.
    """
    if not dist.is_initialized():
        return
    with teardown_deadline(deadline_s, "freeing the backends and the process group"):
        deepep = sys.modules.get("dbo.backends.deepep_buffer")  # imported where DeepEP ran
        if deepep is not None:
            deepep.BUFFER_CACHE.reset()
        gc.collect()
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
