"""GPU conformance of the copy-engine backend: DBO == serial == single-process reference.

From the project root on a host with GPUs (set-up: README.md, "On GPUs")::

    torchrun --nproc-per-node 2 tests/gpu/run_copy_engine.py [--json PATH] [--quick]
    torchrun --nproc-per-node 2 tests/gpu/run_copy_engine.py --stop-test

With fewer GPUs than ranks the ranks share GPU 0 over a gloo group
(``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` is set): the protocol and the numbers are
checked, the timing means nothing. Cases: hidden 2048 and 7168, top-k 1, 2, 4, 8 of 32
experts, even, uneven and zero-token ranks, DBO with 2 and 3 ubatches, each run twice (a
second DBO and serial run must give the same numbers), bf16. ``--stop-test``: the last rank
exits between two layers; every other rank must raise ``CollectiveTimeoutError`` within the
timeout (2 s) instead of hanging. Rank 0 prints one line per (case, rank) and a summary; exit
status 0 only if everything passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dbo.testing.conformance import ConformanceCase, format_results, run_case, with_options  # noqa: E402

NUM_EXPERTS = 32


SELF_SIZED = False  # --self-sized: no max_tokens_per_rank, the backend sizes (and grows) itself


def make_backend(case: ConformanceCase):
    from dbo.backends.copy_engine import make_prepare_finalize

    return make_prepare_finalize(dist.group.WORLD, hidden=case.hidden,
                                 max_tokens_per_rank=None if SELF_SIZED else case.max_tokens_per_rank,
                                 topk=case.topk,
                                 dtype=case.dtype, device="cuda", num_ubatches=case.num_ubatches,
                                 timeout_s=30.0, **dict(case.options))


def build_cases(world: int, quick: bool) -> list[ConformanceCase]:
    tokens = [tuple([128] * world), tuple(128 - 40 * (r % 2) for r in range(world)),
              tuple([0] + [96] * (world - 1))]
    hiddens, topks = ([2048], [2, 8]) if quick else ([2048, 7168], [1, 2, 4, 8])
    cases, seed = [], 0
    for hidden in hiddens:
        for topk in topks:
            for t in tokens:
                seed += 1
                cases.append(ConformanceCase(f"ce h={hidden} k={topk} T={'/'.join(map(str, t))}", t,
                                             hidden, topk, NUM_EXPERTS, intermediate=128, seed=seed,
                                             tol_ref=3e-2, tol_dbo=1e-2))
    cases.append(ConformanceCase("ce 3 ubatches", tokens[0], 2048, 4, NUM_EXPERTS, intermediate=128,
                                 num_ubatches=3, seed=99, tol_ref=3e-2, tol_dbo=1e-2))
    for seed, opts in ((100, {}), (101, {"dequantize_received": False})):  # fp8 dispatch
        cases.append(with_options(ConformanceCase("ce fp8", tokens[1], 2048, 8, NUM_EXPERTS,
                                                  intermediate=128, seed=seed, tol_ref=6e-2, tol_dbo=1e-2),
                                  use_fp8_dispatch=True, **opts))
    return cases


def stop_test(rank: int, world: int) -> bool:
    """The last rank exits before layer 2; the others must fail cleanly and quickly."""
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize
    from dbo.errors import CollectiveTimeoutError
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
    from dbo.moe import MoEKernel, topk_route

    pf = CopyEnginePrepareAndFinalize(hidden_size=1024, max_tokens_per_rank=256, max_topk=4,
                                      device="cuda", timeout_s=2.0)
    kernel = MoEKernel(pf, SwiGLUExperts())
    w1, w2 = make_expert_weights(NUM_EXPERTS, 1024, 128, dtype=torch.bfloat16, seed=1)
    w1 = local_expert_weights(w1, rank, world).cuda()
    w2 = local_expert_weights(w2, rank, world).cuda()
    h = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    t0 = time.monotonic()
    try:
        for layer in range(4):
            if rank == world - 1 and layer == 2:
                print(f"[rank {rank}] stopping before layer 2", flush=True)
                os._exit(0)
            weights, ids = topk_route(torch.randn(256, NUM_EXPERTS, device="cuda"), 4)
            h = kernel(h, w1, w2, weights, ids, global_num_experts=NUM_EXPERTS)
        torch.cuda.synchronize()
    except CollectiveTimeoutError as exc:
        took = time.monotonic() - t0
        print(f"[rank {rank}] PASS stop-test: CollectiveTimeoutError after {took:.2f} s: {exc}",
              flush=True)
        return took < 20
    print(f"[rank {rank}] FAIL stop-test: no error", flush=True)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every rank's results here (rank 0)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stop-test", action="store_true")
    ap.add_argument("--self-sized", action="store_true",
                    help="build the backends without max_tokens_per_rank (sized at the first call, "
                         "grown when a later call needs more)")
    args = ap.parse_args()
    global SELF_SIZED
    SELF_SIZED = args.self_sized
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    shared_gpu = torch.cuda.device_count() < world
    if shared_gpu:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(0 if shared_gpu else rank)
    dist.init_process_group("gloo" if shared_gpu else "nccl",
                            timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        print(f"copy_engine on {world} ranks, {torch.cuda.device_count()} GPU(s)"
              + (" (shared: correctness only)" if shared_gpu else ""), flush=True)
    if args.stop_test:
        ok = stop_test(rank, world)
        if rank == world - 1:  # not reached: that rank exited
            return 0
        os._exit(0 if ok else 1)  # the group is out of step: no clean teardown possible
    results = [run_case(make_backend, c, device="cuda") for c in build_cases(world, args.quick)]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, [r.__dict__ for r in results])
    ok = all(r["ok"] for rank_results in everyone for r in rank_results)
    if rank == 0:
        from dbo.testing.conformance import CaseResult

        flat = [CaseResult(**r) for rank_results in everyone for r in rank_results]
        print(format_results(flat))
        print(f"{'PASS' if ok else 'FAIL'}: {sum(r.ok for r in flat)}/{len(flat)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everyone, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
