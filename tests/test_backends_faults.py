"""A rank that fails or stops mid-step makes the others fail with a clear error, in bounded time.

One rank raises, exits or stalls between two MoE layers of a step; every other rank must fail
with ``CollectiveTimeoutError`` (wrapped in ``UBatchError`` under DBO) within the backend's
``timeout_s`` plus a margin, never hang. The world is respawned after each case because the
process group is left out of step.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from dbo.backends.all2all import AllToAllPrepareAndFinalize
from dbo.backends.naive import NaivePrepareAndFinalize
from dbo.experts import SwiGLUExperts
from dbo.moe import MoEKernel
from dbo.testing.faults import check_survivor, error_chain
from dbo.testing.moe_cases import MoECase, case_inputs
from dbo.ubatch.context import dbo_current_ubatch_id, run_ubatches

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60), pytest.mark.dist_world(kill_on_close=True)]

BACKENDS = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}
TIMEOUT_S = 1.5


def _faulty_step(backend: str, mode: str, use_dbo: bool, fail_rank: int) -> dict:
    """Runs on every rank: three MoE layers; ``fail_rank`` misbehaves before the second."""
    rank = dist.get_rank()
    case = MoECase(11, (8, 8), 8, topk=2)
    inp = case_inputs(case, rank)
    kernel = MoEKernel(BACKENDS[backend](timeout_s=TIMEOUT_S), SwiGLUExperts())

    def layers(lo: int, hi: int):
        h = inp.x[lo:hi]
        for layer in range(3):
            if rank == fail_rank and layer == 1 and dbo_current_ubatch_id() == 0:
                if mode == "raise":
                    raise RuntimeError("injected failure")
                if mode == "exit":
                    os._exit(3)
                time.sleep(TIMEOUT_S + 1.0)  # "stop": stall past the timeout, then give up
                raise RuntimeError("stalled rank gave up")
            h = h + kernel(h, inp.w1, inp.w2, inp.topk_weights[lo:hi], inp.topk_ids[lo:hi],
                           global_num_experts=case.num_experts)
        return h

    t0 = time.monotonic()
    try:
        if use_dbo:
            run_ubatches([lambda: layers(0, 4), lambda: layers(4, 8)], device="cpu")
        else:
            layers(0, 8)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "chain": error_chain(exc), "elapsed_s": time.monotonic() - t0}
    return {"ok": True, "chain": [], "elapsed_s": time.monotonic() - t0}


@pytest.mark.parametrize("backend, mode, use_dbo, fail_rank", [
    ("naive", "raise", True, 1),
    ("all2all", "exit", True, 1),
    ("all2all", "stop", False, 0),
    ("naive", "exit", False, 0),
    ("all2all", "raise", True, 0),
    ("naive", "stop", True, 1),
])
def test_peer_failure_is_a_bounded_clear_error(world2, backend, mode, use_dbo, fail_rank):
    t0 = time.monotonic()
    try:
        outcomes = world2.run_outcomes(_faulty_step, backend, mode, use_dbo, fail_rank,
                                       timeout_s=30)
        step_s = time.monotonic() - t0
    finally:
        world2.restart()  # not timed: starting two ranks on a loaded machine is not the step
    chain = check_survivor(outcomes[1 - fail_rank], use_dbo=use_dbo, timeout_s=TIMEOUT_S)
    msg = dict(chain)["CollectiveTimeoutError"]
    assert f"{backend} " in msg and "peer rank failed or stopped" in msg, msg
    failed = outcomes[fail_rank]
    if mode == "exit":
        assert failed.exitcode == 3, failed
    else:
        assert failed.ok and not failed.value["ok"], failed
    assert step_s < 30
