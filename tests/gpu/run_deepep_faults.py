"""A dead, stalled or slow peer inside DeepEP calls, at N ranks (gloo group).

Run from the project root (one invocation, a few minutes)::

    python3 tests/gpu/run_deepep_faults.py --json out/faults.json              # 2 ranks
    python3 tests/gpu/run_deepep_faults.py --nproc 8 --json out/faults_8.json  # 8 ranks

For each case the driver starts a fresh set of ``--nproc`` ranks (2, 4 or 8: the 8 experts split
evenly; a rank that exits leaves its group out of step): with at least N GPUs visible, rank ``r``
on ``cuda:r``; with fewer, all of them on ``cuda:0`` (correctness only). It runs
:func:`dbo.testing.faults.faulty_step` on every rank (a fault-free reference step of 3 MoE
layers, then the faulty step, serial or DBO) and reads back each rank's result, exit status and
stderr. The last rank misbehaves; every other rank is a survivor. Cases, for ``deepep_ht`` and
``deepep_ll``, serial and DBO: the peer exits before dispatch; exits between the send and its
receive (``exit_after_send``); exits before combine; stalls past the timeout; is slow but within
it (every rank's output must match its reference); plus ``gpu_stall`` under DBO (the peer's host
arrives, its GPU is kept busy past the timeout). A survivor passes when it returned no output and
either raised ``CollectiveTimeoutError`` naming the backend and the misbehaving rank among the
missing ones, or was ended by the GPU watchdog (exit status 75, the message on stderr), in both
cases within the timeout + 3 s of the fault; a case passes when every survivor does. The time
from the fault to each survivor's error is printed per case (with more than one survivor, each
one's and the slowest).

``--bench`` also times a fault-free step (8 layers, 128 tokens per rank) with the peer checks
on and off, alternating, for both backends, serial and DBO (rank 0's times).

``--fake`` runs the host cases on CPU with dbo.testing's fake deep_ep (no GPU).

Exit status: 0 if every case passed; 1 otherwise; 2 bad option; 3: deep_ep missing; 4: no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

CASES = [(kind, fault, dbo) for kind in ("ht", "ll") for dbo in (False, True)
         for fault in ("exit_before_dispatch", "exit_after_send", "exit_before_combine", "stall", "slow")]
CASES += [("ht", "gpu_stall", True), ("ll", "gpu_stall", True)]
#: a survivor's error must come within the timeout plus this many seconds of the fault
TARGET_SLACK_S = 3.0


# ---- worker ------------------------------------------------------------------------------------


def _init(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    if args.fake:
        from dbo.testing.fake_deep_ep import ensure_fake_deep_ep

        ensure_fake_deep_ep("v1")
    else:
        torch.cuda.set_device(args.rank if args.gpu_per_rank else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=60))


def _bench(timeout_s: float, iters: int) -> dict:
    """Step time (ms, median over alternating rounds) with the peer checks on and off."""
    import torch
    import torch.distributed as dist

    from dbo.experts.swiglu import SwiGLUExperts
    from dbo.moe.kernel import MoEKernel
    from dbo.testing.faults import fault_inputs, make_deepep_backend, per_launch_check_cost
    from dbo.ubatch.context import run_ubatches

    tokens, layers = 128, 8
    out = {}
    x, weights, ids, w1, w2 = fault_inputs(dist.get_rank(), tokens, torch.device("cuda"))
    for kind in ("ht", "ll"):
        pf = make_deepep_backend(kind, tokens, timeout_s, torch.device("cuda"))
        kernel = MoEKernel(pf, SwiGLUExperts())

        def part(lo: int, hi: int, kernel: MoEKernel = kernel) -> torch.Tensor:
            h = x[lo:hi]
            for _ in range(layers):
                h = h + kernel(h, w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=8)
            return h

        for use_dbo in (False, True):
            def step(use_dbo: bool = use_dbo) -> None:
                if use_dbo:
                    run_ubatches([lambda: part(0, tokens // 2), lambda: part(tokens // 2, tokens)])
                else:
                    part(0, tokens)

            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(iters):
                for checks in ((True, False) if i % 2 else (False, True)):
                    pf.peer_checks = checks
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    times[checks].append((time.perf_counter() - t0) * 1e3)
            pf.peer_checks = True
            key = f"{kind}_{'dbo' if use_dbo else 'serial'}"
            out[key] = {"on_ms": statistics.median(times[True][2:]),
                        "off_ms": statistics.median(times[False][2:])}
    out["per_launch_us"] = per_launch_check_cost()
    return out


def worker(args: argparse.Namespace) -> int:
    _init(args)
    result: dict = {}
    try:
        if args.bench:
            result = {"bench": _bench(args.timeout, args.bench_iters)}
        else:
            from dbo.testing.faults import faulty_step

            result = faulty_step(args.kind, args.fault, args.dbo, args.nproc - 1, args.timeout,
                                 device="cpu" if args.fake else "cuda", tokens=32, stamp_path=args.stamp)
    except BaseException as exc:  # noqa: BLE001 - reported
        from dbo.testing.faults import error_chain

        result = {"ok": False, "chain": error_chain(exc), "setup_error": True, "error_time": time.time()}
    with open(args.result, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a DeepEP buffer's destroy would wait for a dead peer


# ---- driver ------------------------------------------------------------------------------------

#: the ranks a timeout message names as missing ("rank 3 did not arrive", "ranks 1, 3 did not ...")
_MISSING = re.compile(r"\branks? (\d+(?:, \d+)*) did not arrive")


def _spawn(tmp: str, tag: str, extra: list[str], args: argparse.Namespace) -> list[dict]:
    from dbo.testing.ranks import free_port, spawn_ranks

    port = free_port()

    def argv(rank: int, files: dict[str, str]) -> list[str]:
        return [sys.executable, __file__, "--worker", "--rank", str(rank), "--port", str(port),
                "--nproc", str(args.nproc), "--timeout", str(args.timeout), "--result", files["result"],
                "--stamp", os.path.join(tmp, f"{tag}.stamp"), *extra, *(["--fake"] if args.fake else []),
                *(["--gpu-per-rank"] if args.gpu_per_rank else [])]

    return spawn_ranks(argv, tmp, tag, world_size=args.nproc, fork=args.fork_ranks)


def _survivor(case: tuple, proc: dict, fail_rank: int, stamp: float | None, timeout_s: float) -> dict:
    """One survivor's outcome: what ended its faulty step, how long after the fault, its verdict
    (None: the documented ``deepep_ht`` GPU-stall gap)."""
    from dbo.peers.watchdog import GPU_WAIT_TIMEOUT_EXIT_CODE

    kind, fault, _ = case
    res = proc["result"]
    if res is not None and res.get("ok"):
        outcome, err_time, msg = "returned output (should not)", None, ""
    elif res is not None:
        outcome, err_time = f"raised {res['chain'][-1][0]}", res.get("error_time")
        msg = res["chain"][-1][1]
    elif proc["code"] == GPU_WAIT_TIMEOUT_EXIT_CODE:
        outcome, err_time = "ended by the GPU watchdog (75)", proc["exit_time"]
        lines = [ln for ln in proc["stderr"].splitlines() if "[dbo watchdog]" in ln]
        msg = lines[-1] if lines else ""
    elif proc["code"] == 1 and proc["deadline"][0]:
        outcome, err_time = "ended by the GIL-free deadline (exit 1)", proc["exit_time"]
        timeout_line, named_line = proc["deadline"]
        msg = named_line or timeout_line
    else:
        outcome, err_time, msg = f"exit {proc['code']}", proc["exit_time"], proc["stderr"][-300:]
    to_error = None if (err_time is None or stamp is None) else err_time - stamp
    missing = _MISSING.search(msg)
    named = (f"deepep_{kind}" in msg and missing is not None
             and fail_rank in {int(r) for r in missing.group(1).split(", ")}) or (
        fault == "gpu_stall" and "did not arrive" in msg)
    clean = outcome in ("raised CollectiveTimeoutError", "ended by the GPU watchdog (75)") or (
        outcome.startswith("ended by the GIL-free deadline") and "[dbo watchdog]" in msg)
    in_time = to_error is not None and to_error <= timeout_s + TARGET_SLACK_S
    row = {"rank": proc["rank"], "exit": proc["code"], "outcome": outcome,
           "time_to_error_s": None if to_error is None else round(to_error, 2), "message": msg[:400],
           "passed": bool(clean and named and in_time)}
    if (kind, fault) == ("ht", "gpu_stall"):
        # the wait is DeepEP's host loop for the receive counts, which holds the GIL, so no
        # watchdog thread can act: the GIL-free deadline ends the process, the wait named in its
        # stacks (a pass, as the GPU watchdog's end is). Without it the step completes once the
        # peer's GPU comes back (timeout + 3 s): counted apart (passed None) if the output is
        # right, as is an end in time whose stacks do not name the wait.
        if res is not None and res.get("ok"):
            right = res.get("rel_err", 1) < 2e-2
            row.update(outcome="completed late (DeepEP host wait, GIL held)", rel_err=res.get("rel_err"),
                       slow_step_s=res.get("elapsed_s"), passed=None if right else False)
        elif outcome.startswith("ended by the GIL-free deadline") and not row["passed"]:
            row["passed"] = None if in_time else False
    return row


def _judge(case: tuple, procs: list[dict], stamp_path: str, timeout_s: float) -> dict:
    """The case's row: every survivor's outcome (``survivors``), the slowest one's time to error,
    the worst one's outcome and message, and the verdict (all survivors passed, the exiting peer
    ended with its own status)."""
    from dbo.testing.faults import FAULT_EXIT_CODE

    kind, fault, dbo = case
    fail_rank = len(procs) - 1
    failed = procs[fail_rank]
    row = {"backend": f"deepep_{kind}", "fault": fault, "mode": "dbo" if dbo else "serial",
           "nproc": len(procs), "peer_exit": failed["code"]}
    try:
        with open(stamp_path) as f:
            stamp = float(f.read())
    except (OSError, ValueError):
        stamp = None
    if fault == "slow":
        results = [p["result"] for p in procs]
        ok = all(r and r.get("ok") and r["rel_err"] < 2e-2 for r in results)
        rel_errs = [r.get("rel_err") if r else None for r in results]
        steps = [r.get("elapsed_s") if r else None for r in results]
        row.update(survivor_exit=max(p["code"] for p in procs[:fail_rank]),
                   outcome="completed" if ok else "FAILED",
                   rel_err=None if None in rel_errs else max(rel_errs),
                   slow_step_s=None if None in steps[:fail_rank] else max(steps[:fail_rank]), passed=ok,
                   survivors=[{"rank": p["rank"], "exit": p["code"], "rel_err": rel_errs[p["rank"]],
                               "slow_step_s": steps[p["rank"]]} for p in procs[:fail_rank]])
        return row
    survivors = [_survivor(case, p, fail_rank, stamp, timeout_s) for p in procs[:fail_rank]]
    times = [s["time_to_error_s"] for s in survivors]
    slowest = None if None in times else max(survivors, key=lambda s: s["time_to_error_s"])
    # the row shows a failing survivor first, then a gap, then the slowest
    worst = max(survivors, key=lambda s: (s["passed"] is False, s["passed"] is None,
                                          math.inf if s["time_to_error_s"] is None else s["time_to_error_s"]))
    verdicts = [s["passed"] for s in survivors]
    peer_ok = failed["code"] == FAULT_EXIT_CODE if fault.startswith("exit") else True
    passed = False if (False in verdicts or not peer_ok) else None if None in verdicts else True
    row.update(survivor_exit=worst["exit"], outcome=worst["outcome"],
               time_to_error_s=None if slowest is None else slowest["time_to_error_s"],
               slowest_rank=None if slowest is None else slowest["rank"], message=worst["message"],
               passed=passed, survivors=survivors)
    row.update({k: worst[k] for k in ("rel_err", "slow_step_s") if k in worst})
    return row


def _print_row(row: dict, procs: list[dict]) -> None:
    verdict = {True: "PASS", False: "FAIL", None: "GAP "}[row["passed"]]
    print(f"{verdict} {row['backend']:9s} {row['mode']:6s} {row['fault']:21s} {row['outcome']:40s} "
          f"time to error {row.get('time_to_error_s')} s  ({row['case_wall_s']} s)", flush=True)
    survivors = row["survivors"]
    if len(survivors) > 1 and row["fault"] != "slow":
        each = ", ".join(f"rank {s['rank']} {s['time_to_error_s']} s"
                         + ("" if s["passed"] else f" ({s['outcome']})") for s in survivors)
        print(f"    survivors: {each}; slowest: rank {row['slowest_rank']}", flush=True)
    if row["passed"] is False:
        print("   message:", row.get("message"), flush=True)
        for p in procs:
            print(f"   rank {p['rank']} exit {p['code']} stderr tail:\n"
                  + "\n".join("     " + ln for ln in p["stderr"].splitlines()[-12:]), flush=True)
    elif row.get("message"):
        print("   ", row["message"][:300], flush=True)


def driver(args: argparse.Namespace) -> int:
    import torch

    from dbo.testing.ranks import collect_ranks, poll_ranks

    if not args.fake and not torch.cuda.is_available():
        print("SKIP: no GPU", flush=True)
        return 4
    try:
        if not args.fake:
            import deep_ep  # noqa: F401
    except ImportError as exc:
        print(f"SKIP: deep_ep is not importable ({exc})", flush=True)
        return 3
    args.gpu_per_rank = not args.fake and not args.shared_gpu and torch.cuda.device_count() >= args.nproc
    layout = ("fake deep_ep on CPU" if args.fake else "one GPU per rank" if args.gpu_per_rank
              else "all on GPU 0")
    print(f"{args.nproc} ranks per case ({layout}), rank {args.nproc - 1} misbehaves; timeout_s="
          f"{args.timeout}, target: every survivor's named error within {args.timeout + TARGET_SLACK_S} s",
          flush=True)
    # the fake's receive is a gloo wait that needs the peer, and it has no GPU to stall
    gpu_only = ("gpu_stall", ("ll", "exit_after_send", True))
    cases = [c for c in CASES if c[0] in args.backends and (not args.only or c[1] in args.only)
             and ("dbo" if c[2] else "serial") in args.modes
             and not (args.fake and (c[1] in gpu_only or c in gpu_only))]
    rows, t_all = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        queue = list(enumerate(cases))
        running: list[tuple[int, tuple, list[dict], str, float]] = []
        while queue or running:
            while queue and len(running) < args.parallel:
                i, case = queue.pop(0)
                kind, fault, dbo = case
                extra = ["--kind", kind, "--fault", fault] + (["--dbo"] if dbo else [])
                procs = _spawn(tmp, f"c{i}", extra, args)
                running.append((i, case, procs, os.path.join(tmp, f"c{i}.stamp"), time.time()))
            time.sleep(0.05)
            for item in list(running):
                i, case, procs, stamp, t0 = item
                if poll_ranks(procs) or time.time() - t0 > args.case_limit:
                    running.remove(item)
                    collect_ranks(procs, t0 + args.case_limit)
                    row = _judge(case, procs, stamp, args.timeout)
                    row["case_wall_s"] = round(time.time() - t0, 1)
                    rows.append(row)
                    _print_row(row, procs)
        bench = None
        if args.bench:
            procs = _spawn(tmp, "bench", ["--bench", "--bench-iters", str(args.bench_iters)], args)
            collect_ranks(procs, time.time() + 240)
            bench = procs[0]["result"]
            print("step time with / without the peer checks (ms, median):", json.dumps(bench), flush=True)
            if not bench or "bench" not in bench:
                print(procs[0]["stderr"][-2000:], flush=True)
    order = {case: i for i, case in enumerate(cases)}
    rows.sort(key=lambda r: order[(r["backend"][len("deepep_"):], r["fault"], r["mode"] == "dbo")])
    passed = sum(r["passed"] is True for r in rows)
    gaps = sum(r["passed"] is None for r in rows)
    print(f"{passed}/{len(rows)} cases passed, {gaps} known gap(s) (see docs/backends.md), {args.nproc} "
          f"ranks ({layout}), in {time.time() - t_all:.0f} s (timeout_s={args.timeout})", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "gpus": layout, "timeout_s": args.timeout,
                       "target_s": args.timeout + TARGET_SLACK_S, "cases": rows, "bench": bench}, f, indent=1)
    return 0 if passed + gaps == len(rows) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--stamp", default="", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="ht", help=argparse.SUPPRESS)
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    p.add_argument("--dbo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpu-per-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks per case, 2, 4 or 8 (the last one misbehaves; a GPU each where N are visible)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on GPU 0 even where N GPUs are visible (as with fewer)")
    p.add_argument("--timeout", type=float, default=3.0, help="the backends' timeout_s")
    p.add_argument("--backends", nargs="+", choices=("ht", "ll"), default=["ht", "ll"])
    p.add_argument("--only", nargs="*", choices=sorted({c[1] for c in CASES}), default=None,
                   help="run only these faults")
    p.add_argument("--modes", nargs="+", choices=("serial", "dbo"), default=["serial", "dbo"])
    p.add_argument("--parallel", type=int, default=2, help="cases at once (each starts --nproc ranks)")
    p.add_argument("--fork-ranks", action="store_true",
                   help="start each rank as a fork of a server that has imported torch, not as a new "
                        "interpreter (about 3 s less CPU a rank: the CPU tests)")
    p.add_argument("--case-limit", type=float, default=90.0, help="seconds before a case is killed")
    p.add_argument("--bench", action="store_true", help="time steps with the checks on and off")
    p.add_argument("--bench-iters", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--fake", action="store_true",
                   help="dry run on CPU with the fake deep_ep (no GPU cases, no GPU watchdog)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from dbo.testing.faults import E as num_experts

    allowed = [n for n in range(2, num_experts + 1) if num_experts % n == 0]
    if args.nproc not in allowed:
        p.error(f"--nproc must be one of {allowed} (the {num_experts} experts split evenly over the "
                f"ranks), got {args.nproc}")
    if args.parallel < 1 or args.timeout <= 0:
        p.error(f"--parallel must be >= 1 and --timeout > 0, got {args.parallel} and {args.timeout}")
    if args.bench and args.fake:
        p.error("--bench times DeepEP on a GPU: not with --fake")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
