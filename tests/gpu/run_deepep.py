"""GPU conformance of the DeepEP backends: DBO == serial == single-process reference.

Run on a host with 2 (or N: 4, 8) GPUs and DeepEP's ``Buffer`` wheel, from the project root::

    pip install -e ".[deepep]"                    # once (no index access: README.md, "On GPUs")
    torchrun --nproc-per-node 2 tests/gpu/run_deepep.py

Options: ``--backends ht ll``, ``--hidden 2048 7168``, ``--topk 1 2 ... 8``, ``--quick`` (fewer
cases), ``--fp8`` (fp8-dispatch cases for every backend), ``--json PATH`` (write every rank's
results). Rank 0 prints one PASS/FAIL line per
(case, rank) and a summary; the exit status is 0 only if every case passed on every rank.

Cases: bf16, 32 experts, SwiGLU experts with intermediate 128; deepep_ht over token counts
(128, 96), (0, 64) (rank 0 has no tokens) and (256, 256), plus fp8 dispatch (top-k 8); deepep_ll with
max 128 tokens per rank over (64, 48) and (128, 128); each for every hidden and top-k. Exit
status 3: deep_ep missing; 4: fewer than 2 GPUs.
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

from dbo.testing.conformance import ConformanceCase, format_results, run_case  # noqa: E402

NUM_EXPERTS = 32
LL_MAX_TOKENS = 128


def make_backend(case: ConformanceCase):
    opts = dict(case.options)
    name = opts.pop("backend")
    if name == "ht":
        from dbo.backends import deepep_ht as mod
    else:
        from dbo.backends import deepep_ll as mod
    return mod.make_prepare_finalize(dist.group.WORLD, hidden=case.hidden,
                                     max_tokens_per_rank=opts.pop("max_tokens", case.max_tokens_per_rank),
                                     num_experts=case.num_experts, topk=case.topk, dtype=case.dtype,
                                     device="cuda", **opts)


def _opts(backend: str) -> tuple:
    return (("backend", backend),) + ((("max_tokens", LL_MAX_TOKENS),) if backend == "ll" else ())


def _widen(tokens: tuple[int, int], world: int) -> tuple[int, ...]:
    """A 2-rank token pattern for ``world`` ranks: the first rank's count, then the second's."""
    return (tokens[0],) + (tokens[1],) * (world - 1)


def build_cases(args: argparse.Namespace, world: int = 2) -> list[ConformanceCase]:
    cases = []
    ht_tokens = [(128, 96), (0, 64), (256, 256)]
    ll_tokens = [(64, 48), (128, 128)]
    if args.quick:
        ht_tokens, ll_tokens = [(128, 96), (0, 64)], [(64, 48)]
    seed = 0
    for backend in args.backends:
        for hidden in args.hidden:
            for topk in args.topk:
                for tokens in (ht_tokens if backend == "ht" else ll_tokens):
                    tokens = _widen(tokens, world)
                    seed += 1
                    opts = _opts(backend)
                    cases.append(ConformanceCase(
                        f"{backend} h={hidden} k={topk} T={tokens[0]}/{tokens[1]}", tokens, hidden, topk,
                        NUM_EXPERTS, intermediate=128, seed=seed, tol_ref=3e-2, tol_dbo=1e-2,
                        options=opts))
        if backend == "ll":
            # sbo: the batch unsplit, a combine per expert group (2 and 4 groups); sbo+dbo: two
            # ubatches, each with its group combines
            for hidden in args.hidden:
                for schedule, groups in (("sbo", 2), ("sbo", 4), ("sbo+dbo", 2), ("sbo+dbo", 4)):
                    seed += 1
                    cases.append(ConformanceCase(
                        f"ll {schedule} G={groups} h={hidden} k=8 T=128/128", _widen((128, 128), world),
                        hidden, 8, NUM_EXPERTS, intermediate=128, seed=seed, tol_ref=3e-2, tol_dbo=1e-2,
                        expert_schedule=schedule, sbo_groups=groups, options=_opts(backend)))
        if args.fp8 or (backend == "ht" and not args.quick):
            for hidden in args.hidden:
                seed += 1
                cases.append(ConformanceCase(
                    f"{backend} fp8 h={hidden} k=8 T=128/96", _widen((128, 96), world), hidden, 8,
                    NUM_EXPERTS,
                    intermediate=128, seed=seed, tol_ref=8e-2, tol_dbo=1e-2,
                    options=_opts(backend) + (("use_fp8_dispatch", True),)))
    return cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["ht", "ll"], choices=["ht", "ll"])
    p.add_argument("--hidden", nargs="+", type=int, default=[2048, 7168])
    p.add_argument("--topk", nargs="+", type=int, default=list(range(1, 9)))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fp8", action="store_true", help="fp8-dispatch cases for every backend")
    p.add_argument("--json", default=None)
    p.add_argument("--shared-gpu", action="store_true",
                   help="with one GPU: both ranks on GPU 0 over a gloo group (a correctness probe; "
                        "DeepEP may refuse it)")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    shared = args.shared_gpu and torch.cuda.device_count() < 2
    if torch.cuda.device_count() < 2 and not shared:
        print(f"SKIP: needs 2 GPUs, found {torch.cuda.device_count()}", flush=True)
        return 4
    try:
        import deep_ep  # noqa: F401
    except ImportError as exc:
        from dbo.backends.deepep.buffer import INSTALL_HINT
        print(f"SKIP: deep_ep is not importable ({exc}). {INSTALL_HINT}", flush=True)
        return 3
    if shared:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=180),
                                device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 or NUM_EXPERTS % world or (not shared and world > torch.cuda.device_count()):
        print(f"run with torchrun --nproc-per-node N, 2 <= N <= the GPUs, N dividing {NUM_EXPERTS}",
              flush=True)
        return 2
    cases = build_cases(args, world)
    # create each buffer at its largest size first, so later cases reuse it
    for backend in args.backends:
        probe = ConformanceCase("probe", (1,) * world, max(args.hidden), max(args.topk), NUM_EXPERTS,
                                options=_opts(backend))
        make_backend(probe)
    results = []
    t0 = time.time()
    failed_hard = False
    for case in cases:
        if failed_hard:
            break
        try:
            results.append(run_case(make_backend, case, device="cuda"))
        except Exception as exc:  # noqa: BLE001 - reported, then stop: the group may be out of step
            import traceback
            traceback.print_exc()
            from dbo.testing.conformance import CaseResult
            results.append(CaseResult(case.name, rank, case.num_tokens[rank], float("nan"), float("nan"),
                                      float("nan"), 0, 0, 0, False, [f"{type(exc).__name__}: {exc}"]))
            failed_hard = True
        if rank == 0:
            print(results[-1].row(), flush=True)
        # stop together: a rank that failed may have left the group out of step
        stop = torch.tensor([1 if failed_hard else 0], device="cuda")
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        failed_hard = bool(stop.item())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [r.__dict__ for r in results])
    ok = True
    if rank == 0:
        from dbo.testing.conformance import CaseResult
        rows = [CaseResult(**d) for per in gathered for d in per]
        rows.sort(key=lambda r: (r.case, r.rank))
        ok = all(r.ok for r in rows) and len(rows) == len(cases) * world
        print("\n===== deepep GPU conformance (both ranks) =====")
        print(format_results(rows))
        n_pass = sum(r.ok for r in rows)
        print(f"===== {'PASS' if ok else 'FAIL'}: {n_pass}/{len(cases) * world} (case, rank) passed "
              f"in {time.time() - t0:.1f} s; torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()} x{world} =====", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([r.__dict__ for r in rows], f, indent=1)
    flag = torch.tensor([1 if ok else 0], device="cuda")
    dist.broadcast(flag, 0)
    from dbo.backends.deepep.buffer import BUFFER_CACHE
    BUFFER_CACHE.reset()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
