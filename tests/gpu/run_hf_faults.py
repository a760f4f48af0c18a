"""A rank that exits or stalls mid-step on the transformers path, and what its peers see.

From the project root (``--device cuda``: NCCL, a GPU per rank; ``cpu``: gloo)::

    python3 tests/gpu/run_hf_faults.py --json out/hf_faults.json
    python3 tests/gpu/run_hf_faults.py --device cpu --impl dbo_copy_engine all_to_all

A tiny random Qwen3-MoE checkpoint (2 MoE layers, 8 experts, top-2) is written once; each case
starts ``--nproc`` fresh rank processes (``hf_fault_rank.py``: a fault leaves its group out of
step, and torchrun would end the survivors as soon as one rank exits, the very thing measured).
Each rank loads it with
``from_pretrained(..., distributed_config=...)`` (``dbo.bench.hf.model``), runs the case's
operation without a fault (DBO against plain: logits or greedy tokens must agree), then again
with the last rank's first MoE layer misbehaving (:class:`dbo.testing.faults.Fault` on that
layer's backend object, or on transformers' implementation):

* where: ``prefill``, a ``DBOPrefill(model, timeout_s=T)`` call (two ubatches; the layer's first
  dispatch); ``decode``, the second decode step of ``greedy_generate`` inside
  ``collective_timeout(T)`` (the prefill split, the decode steps plain); ``graph`` (on CUDA),
  ``greedy_generate(cuda_graph=True)`` inside ``collective_timeout(T)``, the rank exiting or
  stalling (host or GPU) before the second replay of its decode graph, where no Python of the
  backends runs (:class:`dbo.integrations.transformers.graph_decode.ReplayPacer` watches the
  replays); ``generate`` (not by default), the same step as ``decode`` of ``model.generate()``
  inside ``collective_timeout(T)``;
* implementations: ``dbo_copy_engine``; ``dbo_deepep`` (DeepEP's high-throughput kernels for the
  prefill, low-latency ones for the decode steps; where ``deep_ep`` imports); transformers' own
  ``all_to_all`` as the comparison (``prefill_logits``, ``model.generate()``; the process group's
  ``timeout=`` is ``--a2a-timeout``);
* faults: the rank exits (``os._exit``) or its host sleeps ``T + 2`` s, before the dispatch,
  between dispatch and combine, or after the combine; on CUDA also its GPU kept busy ``T + 3`` s.

Per case: the survivors' error (type, innermost cause, message), the seconds from the fault to
it, and whether every process exited by itself within ``T + 10`` s of the fault (the ranks tear
down as the examples do, ``dbo.bench.dist.shutdown_distributed``, with a 3 s deadline). A dbo
case passes when every survivor raised a :class:`dbo.errors.DBOError` whose innermost cause is
one too (or was ended by the GPU watchdog, exit status 75, for a wait inside a GPU kernel, or by
the GIL-free deadline, exit status 1 with the wait named in its stacks, for DeepEP's host wait
that holds the GIL) within ``T + 3`` s, the fault-free step before it matched, and no process was
left; transformers' rows are not judged. The misbehaving rank's own error (``peer_error``, its
seconds from the fault ``peer_error_s``) and its last lines of output (``peer_tail``) go in the
JSON with each row, and how many cases ran at once when it started (``cases_at_once``). dbo's
cases run ``--parallel`` at a time, then transformers' ``--a2a-parallel`` at a time, never beside
dbo's: their stuck NCCL kernels spin on the GPUs for the process group's timeout and would slow
the timed cases' kernels. Prints a markdown table; ``--json``.

Exit status: 0 if every dbo case passed; 1 otherwise; 2 bad option; 3 transformers without its
expert-parallel interface; 4 fewer GPUs than ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

IMPLS = ("dbo_copy_engine", "dbo_deepep", "all_to_all")
WHERES = ("prefill", "decode", "graph", "generate")
#: the faults of ``graph`` (the decode steps replayed from a CUDA graph): before a replay, where
#: no Python of the backends runs (dbo.testing.faults.Fault.install_on_graph_replays)
GRAPH_FAULTS = ("exit_before_dispatch", "stall", "gpu_stall")
#: fault (dbo.testing.faults) -> (what the rank does, where)
FAULT_PLACES = {
    "exit_before_dispatch": ("exit", "before dispatch"),
    "exit_before_combine": ("exit", "between dispatch and combine"),
    "exit_after_combine": ("exit", "after combine"),
    "stall": ("host stall", "before dispatch"),
    "stall_before_combine": ("host stall", "between dispatch and combine"),
    "stall_after_combine": ("host stall", "after combine"),
    "gpu_stall": ("GPU stall", "before dispatch"),
    "gpu_stall_before_combine": ("GPU stall", "between dispatch and combine"),
    "gpu_stall_after_combine": ("GPU stall", "after combine"),
}
HOST_FAULTS = tuple(f for f in FAULT_PLACES if not f.startswith("gpu"))
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_fault_rank.py")


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _judge(case: tuple, procs: list[dict], stamp_path: str, args: argparse.Namespace) -> dict:
    """The case's row: what the survivors raised and when, how each process ended, the verdict."""
    from dbo.peers.watchdog import GPU_WAIT_TIMEOUT_EXIT_CODE

    impl, where, fault = case
    what, place = FAULT_PLACES[fault]
    if where == "graph":
        place = "before a replay"
    fail_rank = args.nproc - 1
    row = {"impl": impl, "where": where, "fault": fault, "what": what, "place": place,
           "exit_codes": [p["code"] for p in procs]}
    try:
        with open(stamp_path) as f:
            stamp = float(f.read())
    except (OSError, ValueError):
        stamp = None
    errors, times, named, refs = [], [], [], []
    for p in procs:
        res = p["result"]
        ref = res if res is not None else _read_json(p["files"]["result"] + ".ref")
        if ref is not None:  # (written after the fault-free step: there without a result too)
            refs.append(bool(ref.get("reference_ok")))
        if p["rank"] == fail_rank:  # a stalled rank that came back: what it raised, when, its last words
            row["peer_error"] = res["chain"][-1][0] if res is not None and res["chain"] else None
            row["peer_error_s"] = None if res is None or stamp is None or "error_time" not in res \
                else round(res["error_time"] - stamp, 2)
            row["peer_tail"] = "\n".join([ln for ln in p["stderr"].splitlines() if ln.strip()][-6:])[-900:]
            continue
        if res is not None and res.get("ok"):
            errors.append(("returned output", "", ""))
            named.append(False)
            continue
        if res is not None:
            (top, _), (root, msg) = res["chain"][0], res["chain"][-1]
            if res.get("setup_error"):
                top = f"setup failed: {top}"
            errors.append((top, root, msg))
            at, ok = res["error_time"], res["named"] and not res.get("setup_error")
        elif p["code"] == GPU_WAIT_TIMEOUT_EXIT_CODE:
            lines = [ln for ln in p["stderr"].splitlines() if "[dbo watchdog]" in ln]
            errors.append(("ended by the GPU watchdog (exit 75)", "", lines[-1] if lines else ""))
            at, ok = p["exit_time"], True
        elif p["code"] == 1 and all(p["deadline"]):
            # DeepEP's host wait held the GIL; the GIL-free deadline ended the process, the wait
            # named in the stacks it wrote (dbo.peers.watchdog.call_in_named_frame)
            errors.append(("ended by the GIL-free deadline (exit 1)", "", p["deadline"][1]))
            at, ok = p["exit_time"], True
        else:
            code = p["code"]
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}, no result"
            how += " (by the runner)" if p.get("killed") else ""
            tail = [ln for ln in p["stderr"].splitlines() if ln.strip()]
            errors.append((how, "", tail[-1] if tail else ""))
            at, ok = p["exit_time"], False
        named.append(ok)
        times.append(None if stamp is None else at - stamp)
    top, root, msg = errors[0]
    to_error = None if None in times or not times else max(times)
    exits = [None if stamp is None else p["exit_time"] - stamp for p in procs]
    exited = stamp is not None and all(not p.get("killed") and e <= args.timeout + 10
                                       for p, e in zip(procs, exits, strict=True))
    row.update(error=top, root=root, message=msg[:500], fault_reached=stamp is not None,
               time_to_error_s=None if to_error is None else round(to_error, 2),
               exit_s=[None if e is None else round(e, 2) for e in exits], exited_by_itself=exited,
               killed=[bool(p.get("killed")) for p in procs],
               # the rank's teardown waited for a dead peer until its deadline (hf_fault_rank.py)
               teardown_hung=[("[dbo watchdog]" in p["stderr"] and "did not finish within" in p["stderr"])
                              for p in procs],
               reference_ok=bool(refs) and all(refs))
    if impl == "all_to_all":
        row["passed"] = None  # the comparison: what transformers does, not judged
    else:
        row["passed"] = bool(stamp is not None and all(named) and to_error is not None
                             and to_error <= args.timeout + 3 and exited and row["reference_ok"])
    return row


def _table(rows: list[dict]) -> str:
    out = ["| impl | where | fault | error (innermost cause) | s to error | all exited within "
           "T+10 s | target (T+3 s) | message |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r["error"] + (f" ({r['root']})" if r["root"] and r["root"] != r["error"] else "")
        verdict = {True: "PASS", False: "FAIL", None: "—"}[r["passed"]]
        msg = r["message"].replace("|", "/")[:160]
        exited = "yes" if r["exited_by_itself"] else "NO"
        out.append(f"| {r['impl']} | {r['where']} | {r['what']}, {r['place']} | {err} | "
                   f"{r['time_to_error_s']} | {exited} | {verdict} | {msg} |")
    return "\n".join(out)


def _write_checkpoint(path: str) -> None:
    from dbo.integrations.transformers.presets import tiny_random_model

    tiny_random_model("qwen3_moe", 0).save_pretrained(path)


def driver(args: argparse.Namespace) -> int:
    """Run the cases, ``args.parallel`` at a time; print and write the table; the exit status."""
    import importlib.util

    from dbo.testing.ranks import collect_ranks, poll_ranks

    if importlib.util.find_spec("transformers") is None or \
            importlib.util.find_spec("transformers.distributed.expert_parallel") is None:
        print("SKIP: needs transformers >= 5.23 (its expert-parallel interface) and accelerate", flush=True)
        return 3
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"SKIP: {args.nproc} ranks need {args.nproc} GPUs (NCCL), {torch.cuda.device_count()} visible",
              flush=True)
        return 4
    cases = args.cases
    if any(c[0] == "dbo_deepep" for c in cases) and not args.fake_deep_ep \
            and (args.device != "cuda" or importlib.util.find_spec("deep_ep") is None):
        print("dbo_deepep: skipped (deep_ep is not importable, or not on CUDA)", flush=True)
        cases = [c for c in cases if c[0] != "dbo_deepep"]
    rows, t_all = [], time.time()

    def within_budget() -> bool:
        return args.time_budget_s is None or time.time() - t_all < args.time_budget_s

    with tempfile.TemporaryDirectory(prefix="dbo-hf-faults-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        _write_checkpoint(ckpt)
        # dbo's cases first, then transformers' (the comparison) once none of dbo's runs: a stuck
        # NCCL all-to-all keeps a kernel spinning on the GPU for the process group's timeout, and
        # beside it, time-sliced, the timed cases' kernels (a GPU stall, a trapping wait) would run
        # late. transformers' cases only wait for NCCL's timeout: more of them at once
        queue = sorted(enumerate(cases), key=lambda ic: ic[1][0] == "all_to_all")
        running: list = []
        while running or (queue and within_budget()):
            while queue and within_budget():
                i, case = queue[0]
                a2a = case[0] == "all_to_all"
                if a2a and any(c[0] != "all_to_all" for c, *_ in running):
                    break
                if len(running) >= (args.a2a_parallel if a2a else args.parallel):
                    break
                queue.pop(0)
                at_once = len(running) + 1
                running.append((case, *_launch(args, case, f"c{i}", tmp, ckpt), time.time(), at_once))
            time.sleep(0.05)
            for item in list(running):
                case, procs, stamp, t0, at_once = item
                if poll_ranks(procs) or time.time() - t0 > args.case_limit:
                    running.remove(item)
                    collect_ranks(procs, t0 + args.case_limit)
                    rows.append(_judge(case, procs, stamp, args))
                    rows[-1].update(case_wall_s=round(time.time() - t0, 1), cases_at_once=at_once)
                    _report(rows[-1], procs)
                    _write_json(args, rows, [])  # as it goes: a run cut short keeps its rows
    order = {c: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[(r["impl"], r["where"], r["fault"])])
    not_run = [":".join(c) for _, c in queue]
    judged = [r for r in rows if r["passed"] is not None]
    passed = sum(r["passed"] for r in judged)
    print("\n" + _table(rows) + "\n", flush=True)
    print(f"{passed}/{len(judged)} dbo cases met the target (a named dbo error within T + 3 s, every "
          f"process gone within T + 10 s), T = {args.timeout} s, {args.device}, {args.nproc} ranks, "
          f"in {time.time() - t_all:.0f} s", flush=True)
    if not_run:
        print(f"not run (--time-budget-s {args.time_budget_s}): {' '.join(not_run)}", flush=True)
    _write_json(args, rows, not_run)
    return 0 if passed == len(judged) and not not_run else 1


def _launch(args: argparse.Namespace, case: tuple[str, str, str], tag: str, tmp: str,
            ckpt: str) -> tuple[list[dict], str]:
    """Start the ranks of ``case``; returns them and the path of the fault's time stamp."""
    from dbo.testing.ranks import spawn_ranks

    store, stamp = os.path.join(tmp, f"{tag}.store"), os.path.join(tmp, f"{tag}.stamp")
    pg = ["--pg-timeout", str(args.a2a_timeout)] if case[0] == "all_to_all" else []

    def argv(rank: int, files: dict[str, str]) -> list[str]:
        return [sys.executable, RANK_SCRIPT, "--rank", str(rank), "--store", store,
                "--nproc", str(args.nproc), "--device", args.device, "--ckpt", ckpt,
                "--case", ":".join(case), "--tag", tag, "--timeout", str(args.timeout),
                "--result", files["result"], "--stamp", stamp, *pg,
                *(["--fake-deep-ep"] if args.fake_deep_ep else [])]

    return spawn_ranks(argv, tmp, tag, world_size=args.nproc, fork=args.fork_ranks), stamp


def _report(row: dict, procs: list[dict]) -> None:
    verdict = {True: "PASS", False: "FAIL", None: "(transformers)"}[row["passed"]]
    print(f"{verdict} {row['impl']} {row['where']} {row['fault']}: {row['error']} after "
          f"{row['time_to_error_s']} s; exits {row['exit_s']} s after the fault "
          f"(case {row['case_wall_s']} s)", flush=True)
    if row["passed"] is False:
        for p in procs:
            tail = "\n".join("     " + ln for ln in p["stderr"].splitlines()[-15:])
            print(f"   rank {p['rank']} exit {p['code']}, stderr tail:\n{tail}", flush=True)


def _write_json(args: argparse.Namespace, rows: list[dict], not_run: list[str]) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "nproc": args.nproc, "timeout_s": args.timeout,
                       "a2a_pg_timeout_s": args.a2a_timeout, "cases": rows, "not_run": not_run}, f,
                      indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cuda (NCCL, a GPU per rank; the default where one is visible) or cpu (gloo)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per case (the last one misbehaves)")
    p.add_argument("--fork-ranks", action="store_true",
                   help="start each rank as a fork of a server that has imported torch, not as a new "
                        "interpreter (about 3 s less CPU a rank: the CPU tests)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="T: dbo's wait for a peer (DBOPrefill(timeout_s=T), collective_timeout(T))")
    p.add_argument("--a2a-timeout", type=float, default=None,
                   help="the process group's timeout for transformers' all_to_all rows (default: T)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--where", nargs="+", choices=WHERES, default=None,
                   help="(default: prefill decode, and graph on cuda)")
    p.add_argument("--faults", nargs="+", choices=tuple(FAULT_PLACES), default=None,
                   help="(default: every host fault; on cuda the GPU stalls too)")
    p.add_argument("--case", action="append", default=None, metavar="IMPL:WHERE:FAULT",
                   help="run exactly these cases (repeatable) instead of --impl x --where x --faults")
    p.add_argument("--parallel", type=int, default=None,
                   help="dbo's cases at once (default: 4 on cuda, 2 on cpu)")
    p.add_argument("--a2a-parallel", type=int, default=None,
                   help="transformers' all_to_all cases at once, after dbo's (default: 18 on cuda, 2 on cpu)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no case after this many seconds (the rest are listed as not run)")
    p.add_argument("--case-limit", type=float, default=120.0, help="seconds before a case's ranks are killed")
    p.add_argument("--json", default=None)
    p.add_argument("--fake-deep-ep", action="store_true",
                   help="dbo_deepep on dbo.testing's fake deep_ep (a CPU dry run of the runner)")
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.parallel is None:
        args.parallel = 4 if args.device == "cuda" else 2
    if args.a2a_parallel is None:
        args.a2a_parallel = 18 if args.device == "cuda" else 2
    if args.nproc < 2 or min(args.parallel, args.a2a_parallel) < 1 or args.timeout <= 0:
        p.error(f"--nproc must be >= 2, --parallel and --a2a-parallel >= 1 and --timeout > 0 (got "
                f"{args.nproc}, {args.parallel}, {args.a2a_parallel}, {args.timeout})")
    if args.a2a_timeout is None:
        args.a2a_timeout = args.timeout
    if args.where is None:
        args.where = ["prefill", "decode"] + (["graph"] if args.device == "cuda" else [])
    faults = args.faults or (tuple(FAULT_PLACES) if args.device == "cuda" else HOST_FAULTS)
    args.cases = [tuple(c.split(":")) for c in args.case] if args.case else \
        [(i, w, f) for i in args.impl for w in args.where for f in faults
         if w != "graph" or (i != "all_to_all" and f in GRAPH_FAULTS)]
    for c in args.cases:
        if len(c) != 3 or c[0] not in IMPLS or c[1] not in WHERES or c[2] not in FAULT_PLACES:
            p.error(f"--case {':'.join(c)}: expected IMPL:WHERE:FAULT, IMPL one of {IMPLS}, WHERE one "
                    f"of {WHERES}, FAULT one of {tuple(FAULT_PLACES)}")
        if c[2].startswith("gpu") and args.device != "cuda":
            p.error(f"--case {':'.join(c)}: a GPU stall needs --device cuda")
        if c[1] == "graph" and (args.device != "cuda" or c[0] == "all_to_all" or c[2] not in GRAPH_FAULTS):
            p.error(f"--case {':'.join(c)}: graph (replayed decode steps) needs --device cuda, a dbo "
                    f"implementation and a fault of {GRAPH_FAULTS}")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
