"""A program's process group, from torchrun's environment to its end: :func:`init_distributed`
joins the torchrun group (or starts a one-rank one), :func:`shutdown_distributed` frees the
backends and leaves it without hanging, :func:`distributed` does both around a block (what the
examples and the benchmarks use)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dbo.peers.watchdog import end_process_within, teardown_deadline

__all__ = ["init_distributed", "shutdown_distributed", "distributed", "cuda_context_lost"]

logger = logging.getLogger(__name__)


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the torchrun group (or start a one-rank group when run without torchrun): NCCL on
    ``device="cuda"`` (this rank's GPU is ``LOCAL_RANK``), gloo otherwise. On CPU the ranks of
    this host share its cores, unless ``OMP_NUM_THREADS`` says otherwise. Returns the rank, the
    world size and this rank's device."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dev = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


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
    :func:`dbo.peers.watchdog.teardown_deadline` (``deadline_s``): call it once the results are written.
    After a failure (``wait_for_peers=False``) DeepEP's buffers are not freed (that is collective:
    it would wait for a peer that may be gone) and the process ends within ``deadline_s`` from
    here whatever runs after (:func:`dbo.peers.watchdog.end_process_within`); where the failure
    left this process's CUDA context unusable (:func:`cuda_context_lost`), nothing on the GPU can
    be freed or waited for and the teardown would only hold the process: it ends at once (exit
    status 1, as at the deadline).
    """
    if not dist.is_initialized():
        return
    if not wait_for_peers and cuda_context_lost():
        logger.warning("dbo: this process's CUDA context is unusable after the failure (a kernel "
                       "trapped, such as a GPU wait for a peer that died or stalled): nothing to "
                       "tear down, the process ends now")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not wait_for_peers:
        # after a failure a peer may be gone, and whatever waits on it (DeepEP's collective buffer
        # destruction, NCCL's, the interpreter's own shutdown) would hold this process: it ends
        # within deadline_s whatever runs after, and DeepEP's buffers are left to the process's end
        end_process_within(deadline_s)
    with teardown_deadline(deadline_s, "freeing the backends and the process group"):
        deepep = sys.modules.get("dbo.backends.deepep.buffer")  # imported where DeepEP ran
        if deepep is not None and wait_for_peers:
            deepep.BUFFER_CACHE.reset()
        gc.collect()
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def cuda_context_lost() -> bool:
    """Whether this process's CUDA context is unusable: a sticky error (a kernel trapped, for
    example a copy-engine GPU wait that timed out) makes every later CUDA call fail. A stream
    query reports it without waiting; False where CUDA was never used."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.current_stream().query()
    except RuntimeError:  # torch.AcceleratorError (a RuntimeError): the sticky error
        return True
    return False


@contextlib.contextmanager
def distributed(device: str) -> Iterator[tuple[int, int, torch.device]]:
    """:func:`init_distributed` for the block (``with distributed("cuda") as (rank, world,
    device):``), then :func:`shutdown_distributed`: waiting for the peers when the block ended,
    not when it raised (a failed peer would make it wait for the group's timeout)."""
    joined = init_distributed(device)
    ended = False
    try:
        yield joined
        ended = True
    finally:
        shutdown_distributed(wait_for_peers=ended)
