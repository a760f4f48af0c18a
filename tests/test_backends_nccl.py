"""naive and all2all under NCCL on two GPUs: plain and overlapped vs the reference MoE.

The same cases as the gloo tests, with the CUDA stream protocol (collectives on the comm
stream, the compute stream waiting on their work). Skipped without two GPUs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo.backends.all2all import AllToAllPrepareAndFinalize
from dbo.backends.naive import NaivePrepareAndFinalize
from dbo.testing.moe_cases import check_case, standard_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.dist_world(backend="nccl", pg_timeout_s=120.0),
]

BACKENDS = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}


def _check_cases(backend: str, use_async: bool) -> list[str]:
    rank = dist.get_rank()
    bad = []
    for case in standard_cases(dist.get_world_size()):
        rep = check_case(case, rank, lambda: BACKENDS[backend](use_async=use_async), device="cuda")
        if not rep.ok:
            bad.append(f"rank {rank} {case}: seq {rep.err_seq:.3g} dbo {rep.err_dbo:.3g} "
                       f"dbo-vs-seq {rep.err_dbo_vs_seq:.3g} > {rep.tol}")
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_matches_reference_nccl(world2, backend, use_async):
    bad = [line for rank_bad in world2.run(_check_cases, backend, use_async, timeout_s=240)
           for line in rank_bad]
    assert not bad, "\n".join(bad)
