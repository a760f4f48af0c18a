"""One rank of one case of ``tests/gpu/run_hf_faults.py`` (which starts it; see there).

Loads the case's checkpoint expert-parallel, runs its operation once without a fault (DBO
against plain), then again with the last rank's first MoE layer misbehaving
(:class:`dbo.testing.faults.Fault`), and writes what happened to ``--result`` (JSON): ``ok``
(the operation returned), ``reference_ok``, ``chain`` (the error and its causes), ``named`` (a dbo
error whose innermost cause is a dbo error too, or the CUDA error of a trapped GPU wait that a
:class:`~dbo.errors.CollectiveTimeoutError` above it names), ``error_time`` (wall clock).
Then it tears down as the examples do (``dbo.bench.dist.shutdown_distributed``, within
:data:`TEARDOWN_S`) and exits 0 (returned) or 1 (raised).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

SEQ, PADS, NEW_TOKENS = 8, (0, 3, 0, 1), 4  # per rank: 4 left-padded prompts of 8 tokens
# the teardown's deadline (the examples': 120 s): a teardown that waits for a dead peer (a
# collective buffer destroy, NCCL's communicator teardown, the interpreter's exit) ends the
# process then, with its stack on stderr, rather than holding the case for minutes; a normal one
# takes well under a second. After a failure on NCCL the teardown waits that long every time:
# a stalled peer comes back T + 2 s after its fault, fails T s later and must be gone by T + 10 s
TEARDOWN_S = 3.0


def _start_together(tmp: str, tag: str, rank: int, world: int) -> None:
    """Wait (120 s at most) for every rank of the case to have imported everything: a short
    process-group timeout must not run out while a peer still imports."""
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

    from dbo.experts.reference import relative_error
    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.generate import greedy_generate
    from dbo.peers.watchdog import collective_timeout
    from dbo.split import SplitConfig

    bf16 = next(model.parameters()).dtype == torch.bfloat16

    def generate():  # transformers' own loop (plain forwards), inside dbo's timeout
        with collective_timeout(args.timeout):
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)

    if args.impl == "all_to_all":
        if args.where == "prefill":
            def run():
                return prefill_logits(model, ids, mask, mask_padding_tokens=False)
        else:  # transformers has no other decode loop: "decode" is generate() too
            run = generate
        return run, lambda: (run() is not None, 1)
    if args.where == "generate":
        def reference():
            want, _ = greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS,
                                      config=SplitConfig(enabled=False))
            agree = (generate() == want).float().mean().item()
            return agree >= (0.75 if bf16 else 1.0), 1
        return generate, reference
    if args.where == "prefill":
        prefill = DBOPrefill(model, prefill_split_config(adaptive=False), timeout_s=args.timeout)

        def run():
            return prefill(ids, mask)

        def reference():
            # the first call compiles the experts' kernels, seconds on a busy host: it runs under
            # dbo's default timeout, not the case's T (a peer still compiling is not a fault)
            DBOPrefill(model, prefill_split_config(adaptive=False))(ids, mask)
            got, want = run(), prefill_logits(model, ids, mask)
            valid = mask.bool()
            err = relative_error(got[valid].float(), want[valid].float())
            return err <= (0.1 if bf16 else 1e-4), len(prefill.last_plan.slices)
        return run, reference

    graph = args.where == "graph"  # the decode steps replayed from a CUDA graph

    def run():
        with collective_timeout(args.timeout):
            return greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, cuda_graph=graph)[0]

    def reference():
        got, plan = greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, cuda_graph=graph)
        want, _ = greedy_generate(model, ids, mask, max_new_tokens=NEW_TOKENS,
                                  config=SplitConfig(enabled=False))
        agree = (got == want).float().mean().item()
        return agree >= (0.75 if bf16 else 1.0), len(plan.slices)
    return run, reference


def _fault_target(args: argparse.Namespace, model, built: list, prefill_ubatches: int):
    """``(object, dispatch method, combine method, at)``: the last rank's first MoE layer's
    backend (or transformers' implementation) and the call of it that misbehaves: the prefill's
    first, or the second decode step's (``generate()`` runs every step through the prefill
    backend, in one ubatch); ``(None, "", "", 2)`` for the decode steps replayed from a graph
    (``graph``): the second replay misbehaves."""
    if args.impl == "all_to_all":
        impls = dict((id(m), impl) for m, impl in built)
        first = next(impls[id(m)] for m in model.modules() if id(m) in impls)
        return first, "_dispatch_tokens", "_combine_tokens", 1 if args.where == "prefill" else 3
    if args.where == "graph":  # the second replay of the decode graph (dbo.testing.faults)
        return None, "", "", 2
    from dbo.integrations.transformers.ep_model import expert_parallel_modules

    layer = expert_parallel_modules(model)[0][1]
    if args.where != "decode":
        return layer.kernel.prepare_finalize, "prepare_async", "finalize_async", \
            1 if args.where == "prefill" else 3
    if layer.decode_kernel is not None:  # dbo_deepep: the decode steps' own backend
        return layer.decode_kernel.prepare_finalize, "prepare_async", "finalize_async", 2
    return layer.kernel.prepare_finalize, "prepare_async", "finalize_async", prefill_ubatches + 2


def _case(args: argparse.Namespace, rank: int, world: int, device) -> dict:
    """Load, check the operation without a fault, then run it with the fault on the last rank."""
    import torch
    import torch.distributed as dist

    from dbo.bench.hf.model import load_checkpoint, load_hf_all_to_all
    from dbo.errors import CollectiveTimeoutError, DBOError
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
        # the phase, in the tail of a rank that fails (the runner prints its last lines)
        print(f"hf_fault_rank: rank {rank}: the fault-free reference", file=sys.stderr, flush=True)
        matches, prefill_ubatches = reference()
        with open(args.result + ".ref", "w") as f:  # read where the process ends without a result
            json.dump({"reference_ok": matches}, f)
        target, dispatch, combine, at = _fault_target(args, model, built, prefill_ubatches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        fault = Fault(args.fault, at, args.timeout, args.stamp)
        if rank == world - 1:
            if target is None:
                fault.install_on_graph_replays()
            else:
                fault.install(target, dispatch, combine)
        print(f"hf_fault_rank: rank {rank}: the call with the fault", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported
            error_time = time.time()
            causes = [exc]
            while causes[-1].__cause__ is not None:
                causes.append(causes[-1].__cause__)
            # named: a dbo error whose innermost cause is one too, or the CUDA error of a GPU
            # wait that trapped, which dbo names in a CollectiveTimeoutError above it
            named = isinstance(exc, DBOError) and (
                isinstance(causes[-1], DBOError)
                or any(isinstance(e, CollectiveTimeoutError) for e in causes))
            return {"ok": False, "reference_ok": matches, "chain": error_chain(exc), "named": named,
                    "error_time": error_time, "elapsed_s": time.monotonic() - t0}
    return {"ok": True, "reference_ok": matches, "chain": [], "elapsed_s": time.monotonic() - t0}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from dbo.bench.dist import shutdown_distributed
    from dbo.testing.dist import port_file_store
    from dbo.testing.faults import error_chain

    rank, world = args.rank, args.nproc
    # what torchrun would set: transformers' expert-parallel loading places each rank's shard on
    # the GPU LOCAL_RANK names (cuda:0 everywhere without it)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
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
                            store=port_file_store(args.store, rank, world), **kw)
    try:
        result = _case(args, rank, world, device)
    except BaseException as exc:  # noqa: BLE001 - a failure before the fault: reported
        result = {"ok": False, "setup_error": True, "chain": error_chain(exc), "named": False,
                  "error_time": time.time()}
    with open(args.result, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    shutdown_distributed(wait_for_peers=result["ok"], deadline_s=TEARDOWN_S)
    return 0 if result["ok"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True, metavar="IMPL:WHERE:FAULT")
    for name in ("--rank", "--nproc"):
        p.add_argument(name, type=int, required=True)
    # --store: where rank 0 writes its TCPStore's port (no chosen port to collide on)
    for name in ("--result", "--stamp", "--ckpt", "--tag", "--store"):
        p.add_argument(name, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--timeout", type=float, required=True, help="T: dbo's wait for a peer")
    p.add_argument("--pg-timeout", type=float, default=None, help="the process group's timeout")
    p.add_argument("--fake-deep-ep", action="store_true")
    args = p.parse_args()
    args.impl, args.where, args.fault = args.case.split(":")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
