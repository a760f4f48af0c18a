"""A rank that exits or stalls mid-step on the transformers path, and what its peers see.

Run from the project root (GPUs with NCCL, one per rank; or ``--device cpu``: gloo ranks)::

    python3 tests/gpu/run_hf_faults.py --json out/hf_faults.json
    python3 tests/gpu/run_hf_faults.py --device cpu --impl dbo_copy_engine all_to_all

A tiny random-weight Qwen3-MoE checkpoint (``tiny_random_model("qwen3_moe")``, 2 MoE layers of
8 experts, top-2) is written once, then every case starts a fresh set of ``--nproc`` rank
processes (a case that kills a rank leaves its group out of step, and torchrun would end the
survivors as soon as one rank exits, which is what is measured here). Each rank loads it with
``from_pretrained(..., distributed_config=...)`` (``dbo.bench.hf_model``), runs the case's
operation once without a fault (DBO against plain: the logits, or the greedy tokens, must agree),
then again with the last rank's first MoE layer made to misbehave (:class:`dbo.testing.faults.Fault`
on that layer's backend object):

* where: ``prefill``, a ``DBOPrefill(model, timeout_s=T)`` call (split into two ubatches;
  the layer's first dispatch); ``decode``, the second decode step of
  ``greedy_generate`` inside ``collective_timeout(T)`` (its prefill split, its decode steps
  plain);
* implementations: ``dbo_copy_engine``, ``dbo_deepep`` (DeepEP's high-throughput kernels for
  the prefill, low-latency ones for the decode steps; only where ``deep_ep`` imports), and, as
  the comparison, transformers' own ``all_to_all`` (``prefill_logits`` and ``model.generate()``
  on a process group whose ``timeout=`` is ``--a2a-timeout``);
* faults: the rank exits (``os._exit``) or its host sleeps ``T + 2`` s, before the dispatch,
  between the dispatch and the combine, or after the combine; on CUDA also its GPU kept busy
  ``T + 3`` s (``torch.cuda._sleep``) at the same three places.

Per case, from the surviving ranks: the error (type, innermost cause, message), the seconds from
the fault to it, and whether every process exited by itself within ``T + 10`` s of the fault (the
ranks tear down as the examples do, ``dbo.bench.dist.shutdown_distributed``). A dbo case passes
when every survivor raised a :class:`dbo.errors.DBOError` whose innermost cause is one too (or
was ended by the GPU watchdog, exit status 75, for a wait inside a GPU kernel) within ``T + 3`` s
of the fault, and nothing was left running; transformers' rows show what it does and are not
judged. Prints a markdown table, writes it as JSON (``--json``).

Exit status: 0 if every dbo case passed, 1 otherwise, 2 on a bad option, 3 when transformers has
no expert-parallel interface, 4 with fewer GPUs than ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

IMPLS = ("dbo_copy_engine", "dbo_deepep", "all_to_all")
WHERES = ("prefill", "decode")
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
SEQ, PADS, NEW_TOKENS = 8, (0, 3, 0, 1), 4  # per rank: 4 left-padded prompts of 8 tokens
WATCHDOG_EXIT = 75  # dbo.peers.watchdog.GPU_WAIT_TIMEOUT_EXIT_CODE (not imported: no torch here)


# ---- worker: one rank of one case --------------------------------------------------------------


def _start_together(tmp: str, tag: str, rank: int, world: int) -> None:
    """Wait (at most 120 s) until every rank of the case got here: the imports done, so that a
    short process-group timeout does not run out while a peer still imports."""
    open(os.path.join(tmp, f"{tag}.{rank}.ready"), "w").close()
    deadline = time.time() + 120
    while not all(os.path.exists(os.path.join(tmp, f"{tag}.{r}.ready")) for r in range(world)):
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: the case's other ranks did not start within 120 s")
        time.sleep(0.01)


def _record_all_to_all() -> list:
    """``(experts module, implementation)`` of every transformers ``AllToAllEP`` built from now
    on in this process (to find the first MoE layer's)."""
    from transformers.distributed.expert_parallel import AllToAllEP

    built: list = []
    init = AllToAllEP.__init__

    def recording_init(self, experts, *args, **kwargs):
        init(self, experts, *args, **kwargs)
        built.append((experts, self))

    AllToAllEP.__init__ = recording_init
    return built


def _operation(args: argparse.Namespace, model, ids, mask):
    """``(run, reference)``: the case's operation (returns logits or tokens) and a fault-free
    check of it, returning ``(dbo_matches_plain, prefill ubatches)``."""
    import torch

    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.moe.reference import relative_error
    from dbo.peers.watchdog import collective_timeout
    from dbo.split import SplitConfig

    bf16 = next(model.parameters()).dtype == torch.bfloat16
    if args.impl == "all_to_all":
        if args.where == "prefill":
            def run():
                return prefill_logits(model, ids, mask, mask_padding_tokens=False)
        else:
            def run():
                return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        return run, lambda: (run() is not None, 1)
    if args.where == "prefill":
        prefill = DBOPrefill(model, prefill_split_config(adaptive=False), timeout_s=args.timeout)

        def run():
            return prefill(ids, mask)

        def reference():
            got, want = run(), prefill_logits(model, ids, mask)
            valid = mask.bool()
            err = relative_error(got[valid].float(), want[valid].float())
            return err <= (0.1 if bf16 else 1e-4), len(prefill.last_plan.slices)
        return run, reference

    def run():
        with collective_timeout(args.timeout):
            return greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)[0]

    def reference():
        got, plan = greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
        want, _ = greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS,
                                  config=SplitConfig(enabled=False))
        agree = (got == want).float().mean().item()
        return agree >= (0.75 if bf16 else 1.0), len(plan.slices)
    return run, reference


def _fault_target(args: argparse.Namespace, model, built: list, prefill_ubatches: int):
    """``(object, dispatch method, combine method, at)``: the last rank's first MoE layer's
    backend (or transformers' implementation) and the call of it that misbehaves: the prefill's
    first, or the second decode step's."""
    if args.impl == "all_to_all":
        impls = dict((id(m), impl) for m, impl in built)
        first = next(impls[id(m)] for m in model.modules() if id(m) in impls)
        return first, "_dispatch_tokens", "_combine_tokens", 1 if args.where == "prefill" else 3
    from dbo.integrations.transformers.ep_model import expert_parallel_modules

    layer = expert_parallel_modules(model)[0][1]
    if args.where == "prefill":
        return layer.kernel.prepare_finalize, "prepare_async", "finalize_async", 1
    if layer.decode_kernel is not None:  # dbo_deepep: the decode steps' own backend
        return layer.decode_kernel.prepare_finalize, "prepare_async", "finalize_async", 2
    return layer.kernel.prepare_finalize, "prepare_async", "finalize_async", prefill_ubatches + 2


def _case(args: argparse.Namespace, rank: int, world: int, device) -> dict:
    """Load, check the operation without a fault, then run it with the fault on the last rank."""
    import torch
    import torch.distributed as dist

    from dbo.bench.hf_model import load_checkpoint, load_hf_all_to_all
    from dbo.errors import DBOError
    from dbo.testing.faults import Fault, error_chain
    from dbo.testing.hf import left_padded_prompts

    dtype = torch.bfloat16 if device.type == "cuda" or args.impl == "dbo_deepep" else torch.float32
    built = _record_all_to_all() if args.impl == "all_to_all" else []
    if args.impl == "all_to_all":
        model, mode = load_hf_all_to_all(args.ckpt, dtype, device), torch.no_grad
    else:  # ep_distributed_config("copy_engine" / "deepep")
        model = load_checkpoint(args.ckpt, dtype, device, backend=args.impl.removeprefix("dbo_"))
        mode = torch.inference_mode
    ids, mask = (t.to(device) for t in left_padded_prompts(11 + rank, PADS, SEQ))
    with mode():
        run, reference = _operation(args, model, ids, mask)
        matches, prefill_ubatches = reference()
        target, dispatch, combine, at = _fault_target(args, model, built, prefill_ubatches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        fault = Fault(args.fault, at, args.timeout, args.stamp)
        if rank == world - 1:
            fault.install(target, dispatch, combine)
        t0 = time.monotonic()
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported
            error_time = time.time()
            root = exc
            while root.__cause__ is not None:
                root = root.__cause__
            return {"ok": False, "reference_ok": matches, "chain": error_chain(exc),
                    "named": isinstance(exc, DBOError) and isinstance(root, DBOError),
                    "error_time": error_time, "elapsed_s": time.monotonic() - t0}
    return {"ok": True, "reference_ok": matches, "chain": [], "elapsed_s": time.monotonic() - t0}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from dbo.bench.dist import shutdown_distributed
    from dbo.testing.faults import error_chain

    rank, world = args.rank, args.nproc
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    if args.fake_deep_ep:
        from dbo.testing.fake_deep_ep import ensure_fake_deep_ep

        ensure_fake_deep_ep("v1")
    import dbo.integrations.transformers  # noqa: F401  (registers dbo's implementations)

    _start_together(os.path.dirname(args.result), args.tag, rank, world)
    kw = {} if args.pg_timeout is None else {"timeout": datetime.timedelta(seconds=args.pg_timeout)}
    if device.type == "cuda":
        kw["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{args.port}", **kw)
    try:
        result = _case(args, rank, world, device)
    except BaseException as exc:  # noqa: BLE001 - a failure before the fault: reported
        result = {"ok": False, "setup_error": True, "chain": error_chain(exc), "named": False,
                  "error_time": time.time()}
    with open(args.result, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    shutdown_distributed(wait_for_peers=result["ok"])
    return 0 if result["ok"] else 1


# ---- driver ------------------------------------------------------------------------------------


def _judge(case: tuple, procs: list[dict], stamp_path: str, args: argparse.Namespace) -> dict:
    impl, where, fault = case
    what, place = FAULT_PLACES[fault]
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
        if res is not None:
            refs.append(bool(res.get("reference_ok")))
        if p["rank"] == fail_rank:
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
        elif p["code"] == WATCHDOG_EXIT:
            lines = [ln for ln in p["stderr"].splitlines() if "[dbo watchdog]" in ln]
            errors.append(("ended by the GPU watchdog (exit 75)", "", lines[-1] if lines else ""))
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


def _cases(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    if args.case:
        cases = [tuple(c.split(":")) for c in args.case]
        for c in cases:
            if len(c) != 3 or c[0] not in IMPLS or c[1] not in WHERES or c[2] not in FAULT_PLACES:
                raise SystemExit(f"--case {':'.join(c)}: expected IMPL:WHERE:FAULT with IMPL in {IMPLS}, "
                                 f"WHERE in {WHERES}, FAULT in {tuple(FAULT_PLACES)}")
        return cases
    faults = args.faults or (tuple(FAULT_PLACES) if args.device == "cuda" else HOST_FAULTS)
    return [(i, w, f) for i in args.impl for w in args.where for f in faults]


def driver(args: argparse.Namespace) -> int:
    import importlib.util

    from dbo.testing.faults import collect_ranks, free_port, poll_ranks, spawn_ranks

    if importlib.util.find_spec("transformers") is None or \
            importlib.util.find_spec("transformers.distributed.expert_parallel") is None:
        print("SKIP: needs transformers >= 5.23 (its expert-parallel interface) and accelerate", flush=True)
        return 3
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"SKIP: {args.nproc} ranks need {args.nproc} GPUs (NCCL), {torch.cuda.device_count()} visible",
              flush=True)
        return 4
    cases = _cases(args)
    if any(c[0] == "dbo_deepep" for c in cases) and not args.fake_deep_ep \
            and (args.device != "cuda" or importlib.util.find_spec("deep_ep") is None):
        print("dbo_deepep: skipped (deep_ep is not importable, or not on CUDA)", flush=True)
        cases = [c for c in cases if c[0] != "dbo_deepep"]
    if args.device != "cuda" and any(c[2].startswith("gpu") for c in cases):
        raise SystemExit("GPU stalls need --device cuda")
    rows, t_all = [], time.time()
    with tempfile.TemporaryDirectory(prefix="dbo-hf-faults-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        _write_checkpoint(ckpt)
        queue, running = list(enumerate(cases)), []
        while queue or running:
            while queue and len(running) < args.parallel:
                i, case = queue.pop(0)
                tag, port = f"c{i}", free_port()
                a2a = case[0] == "all_to_all"
                pg = args.a2a_timeout if a2a else None

                def argv(rank, files, case=case, tag=tag, port=port, pg=pg):
                    return [sys.executable, __file__, "--worker", "--rank", str(rank), "--port", str(port),
                            "--nproc", str(args.nproc), "--device", args.device, "--ckpt", ckpt,
                            "--case", ":".join(case), "--tag", tag,
                            "--timeout", str(args.timeout), "--result", files["result"],
                            "--stamp", os.path.join(tmp, f"{tag}.stamp"),
                            *(["--pg-timeout", str(pg)] if pg else []),
                            *(["--fake-deep-ep"] if args.fake_deep_ep else [])]
                procs = spawn_ranks(argv, tmp, tag, world_size=args.nproc)
                running.append((case, procs, os.path.join(tmp, f"{tag}.stamp"), time.time()))
            time.sleep(0.05)
            for item in list(running):
                case, procs, stamp, t0 = item
                if poll_ranks(procs) or time.time() - t0 > args.case_limit:
                    running.remove(item)
                    collect_ranks(procs, t0 + args.case_limit)
                    row = _judge(case, procs, stamp, args)
                    row["case_wall_s"] = round(time.time() - t0, 1)
                    rows.append(row)
                    verdict = {True: "PASS", False: "FAIL", None: "(transformers)"}[row["passed"]]
                    print(f"{verdict} {case[0]} {case[1]} {case[2]}: {row['error']} after "
                          f"{row['time_to_error_s']} s; exits {row['exit_s']} s after the fault "
                          f"(case {row['case_wall_s']} s)", flush=True)
                    if row["passed"] is False:
                        for p in procs:
                            tail = "\n".join("     " + ln for ln in p["stderr"].splitlines()[-15:])
                            print(f"   rank {p['rank']} exit {p['code']}, stderr tail:\n{tail}", flush=True)
    order = {c: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[(r["impl"], r["where"], r["fault"])])
    judged = [r for r in rows if r["passed"] is not None]
    passed = sum(r["passed"] for r in judged)
    print("\n" + _table(rows) + "\n", flush=True)
    print(f"{passed}/{len(judged)} dbo cases met the target (a named dbo error within T + 3 s, every "
          f"process gone within T + 10 s), T = {args.timeout} s, {args.device}, {args.nproc} ranks, "
          f"in {time.time() - t_all:.0f} s", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "nproc": args.nproc, "timeout_s": args.timeout,
                       "a2a_pg_timeout_s": args.a2a_timeout, "cases": rows}, f, indent=1)
    return 0 if passed == len(judged) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--port"):
        p.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--result", "--stamp", "--ckpt", "--tag"):
        p.add_argument(name, default="", help=argparse.SUPPRESS)
    p.add_argument("--pg-timeout", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cuda (NCCL, a GPU per rank; the default where one is visible) or cpu (gloo)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per case (the last one misbehaves)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="T: dbo's wait for a peer (DBOPrefill(timeout_s=T), collective_timeout(T))")
    p.add_argument("--a2a-timeout", type=float, default=None,
                   help="the process group's timeout for transformers' all_to_all rows (default: T)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--where", nargs="+", choices=WHERES, default=list(WHERES))
    p.add_argument("--faults", nargs="+", choices=tuple(FAULT_PLACES), default=None,
                   help="(default: every host fault; on cuda the GPU stalls too)")
    p.add_argument("--case", action="append", default=None, metavar="IMPL:WHERE:FAULT",
                   help="run exactly these cases (repeatable) instead of --impl x --where x --faults")
    p.add_argument("--parallel", type=int, default=2, help="cases at once")
    p.add_argument("--case-limit", type=float, default=120.0, help="seconds before a case's ranks are killed")
    p.add_argument("--json", default=None)
    p.add_argument("--fake-deep-ep", action="store_true",
                   help="dbo_deepep on dbo.testing's fake deep_ep (a CPU dry run of the runner)")
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.nproc < 2 or args.parallel < 1 or args.timeout <= 0:
        p.error(f"--nproc must be >= 2, --parallel >= 1 and --timeout > 0 (got {args.nproc}, "
                f"{args.parallel}, {args.timeout})")
    if args.a2a_timeout is None:
        args.a2a_timeout = args.timeout
    if args.worker:
        args.impl, args.where, args.fault = args.case[0].split(":")
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
