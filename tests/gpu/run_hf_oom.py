"""One rank short of device memory in an overlapped prefill of a transformers model: the group
falls back to the plain forward where the plain one fits, and every rank ends in a named error,
none hanging, where nothing fits.

    torchrun --nproc-per-node 2 tests/gpu/run_hf_oom.py --device cuda --json out/hf_oom.json
    torchrun --nproc-per-node 2 tests/gpu/run_hf_oom.py          # CPU, gloo: a dry run (below)

Every rank loads the checkpoint expert-parallel (``--checkpoint``/``--preset`` as in
``run_hf_soak.py``; default Qwen3-30B-A3B at full size on CUDA) and measures, on ``--batch``
left-padded prompts of ``--seq`` tokens, the plain prefill's transient device memory and the
overlapped one's (:func:`dbo.autotune.timing.transient_bytes`, the largest over the ranks). The
overlapped prefill is then given ``SplitConfig.min_free_bytes`` = its transient + 10%, as the
autotune sets it. Then the last rank fills its GPU with a ballast tensor until
:func:`dbo.split.free_device_bytes` reads ``target`` bytes, and every rank calls the overlapped
prefill:

1. ``fallback``: ``target`` room for the plain call (its transient + 25%, or halfway to
   ``min_free_bytes`` where that is closer), below ``min_free_bytes``. Expected: every rank runs
   plainly (the short rank's plan says ``memory``, the others' ``disagreement``), the logits
   equal the plain prefill's, and, the ballast freed, a call of half the batch overlaps again and
   matches too.
2. ``no-room``: ``target`` a quarter of the plain call's transient, with the plain call's need
   per token known (``DBOPrefill.plain_bytes_per_token``, its transient + 10%, as
   ``DBOPrefill.autotune`` sets it). Expected: every rank raises
   :class:`~dbo.errors.DeviceMemoryError` before the call starts (within 3 s), and, the ballast
   freed, a call of half the batch runs and matches the plain one: the group stayed in step.
3. ``no-room, unmeasured``: the same without that figure. Expected: the short rank raises
   torch's ``OutOfMemoryError`` (in ``UBatchError`` if overlapped) and every other rank
   :class:`~dbo.errors.CollectiveTimeoutError` within ``--timeout`` + 3 s; every process exits.

The group is out of step after case 3, so each rank writes its outcome to ``--json`` with
``.rank<R>`` appended, and rank 0 gathers the files (waiting at most ``--timeout`` + 15 s), prints
the table and the verdict, and writes ``--json``. On CPU there is no device memory to read: the
short rank's free memory is stood in for (``dbo.split.plan.free_device_bytes``) and its plain
forward, in cases 2 and 3, raises ``OutOfMemoryError`` from its first MoE layer; the peers' waits and
the processes' ends are real. Exit status: 0 pass, 1 a case missed, 2 bad option, 3 transformers
without its expert-parallel interface.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from dbo.autotune.timing import MEMORY_MARGIN, transient_bytes
from dbo.bench.cli import ArgumentParser, check_at_least, verdict
from dbo.bench.dist import init_distributed
from dbo.bench.hf.args import (
    add_model_arguments,
    backend_name,
    check_backends,
    check_model_arguments,
    default_checkpoint,
)
from dbo.bench.hf.model import backend_kwargs, load_checkpoint, save_checkpoint
from dbo.errors import CollectiveTimeoutError, DeviceMemoryError
from dbo.integrations.transformers import DBOPrefill, prefill_split_config, use_backend
from dbo.peers.collectives import all_reduce_max
from dbo.split import SplitConfig, free_device_bytes
from dbo.testing.faults import error_chain
from dbo.testing.hf import left_padded_prompts

PROG = "run_hf_oom.py"
SLACK_S = 3.0  # the target: the peers' error within the timeout plus this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--backend", type=backend_name, default=None,
                   help="dbo backend (default: copy_engine on CUDA, all2all on CPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (CUDA 8, CPU 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (CUDA 2048, CPU 16)")
    p.add_argument("--timeout", type=float, default=3.0, help="dbo's wait for a peer (default: 3)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.batch = a.batch or (8 if cuda else 4)
    a.seq = a.seq or (2048 if cuda else 16)
    check_at_least(p, a, 2, "batch")
    check_at_least(p, a, 1, "seq")
    if not a.timeout > 0:
        p.error(f"--timeout {a.timeout}: must be > 0")
    if importlib.util.find_spec("transformers.distributed.expert_parallel") is None:
        print("SKIP: needs transformers >= 5.23 (its expert-parallel interface) and accelerate", flush=True)
        raise SystemExit(3)
    check_model_arguments(p, a)
    default_checkpoint(a, "oom")  # the preset written once, reused while its config.json is there
    a.backend = a.backend or ("copy_engine" if cuda else "all2all")
    check_backends(p, [a.backend], a)
    return a


class _Short:
    """The short rank's device memory: a real ballast on CUDA; on CPU a stand-in for the free
    memory the split vote reads, and (case 2) an ``OutOfMemoryError`` from the first MoE layer."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.ballast: torch.Tensor | None = None
        self.hook = None
        self.patched = None

    def leave_free(self, target: int, raise_oom: bool) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free = free_device_bytes(self.device)
            self.ballast = torch.empty(max(0, free - target), dtype=torch.uint8, device=self.device)
            return free_device_bytes(self.device)
        import dbo.split.plan as plan

        self.patched = plan.free_device_bytes
        plan.free_device_bytes = lambda device=None: target
        if raise_oom:
            moe = next(m for m in self.model.modules() if type(m).__name__.endswith("SparseMoeBlock"))

            def oom(module, args):
                raise torch.OutOfMemoryError("stand-in: the plain forward does not fit either")

            self.hook = moe.register_forward_pre_hook(oom)
        return target

    def release(self) -> None:
        self.ballast = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.patched is not None:
            import dbo.split.plan as plan

            plan.free_device_bytes, self.patched = self.patched, None
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-4
    rel = (got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)
    return bool(rel <= tol)


def _fallback(args, rank, world, model, dbo, plain, ids, mask, need, short) -> dict:
    need_plain, need_split = need
    min_free = dbo.wrapper.config.min_free_bytes
    row: dict = {"case": "fallback", "rank": rank, "need_plain": need_plain, "need_split": need_split,
                 "min_free_bytes": min_free}
    # room for the plain call with a quarter to spare, below what the overlapped one asks for
    target = int(need_plain * 1.25)
    if target >= min_free:
        target = (need_plain + min_free) // 2
    if target <= need_plain:
        row.update(skipped="the overlapped prefill asks for no more than the plain one needs: "
                           "nothing to fall back to")
        return row
    row["target_free"] = target
    if rank == world - 1:
        row["free"] = short.leave_free(target, raise_oom=False)
    want = plain(ids, mask)
    got = dbo(ids, mask)
    plan = dbo.last_plan
    row.update(split=plan.split, reason=plan.reason.value, matches=_matches(got, want))
    short.release()
    half = ids.shape[0] // 2
    again = dbo(ids[:half], mask[:half])
    row.update(next_split=dbo.last_plan.split, next_matches=_matches(again, plain(ids[:half], mask[:half])))
    expected_reason = "memory" if rank == world - 1 else "disagreement"
    row["passed"] = bool(not row["split"] and row["reason"] == expected_reason and row["matches"]
                         and row["next_split"] and row["next_matches"])
    return row


def _call(row: dict, dbo, ids, mask) -> None:
    """One overlapped call, every rank starting together: its error (if any) and seconds."""
    all_reduce_max([0])
    t0 = time.monotonic()
    try:
        dbo(ids, mask)
        if ids.is_cuda:
            torch.cuda.synchronize()
        row.update(error=None, seconds=time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the outcome measured
        chain = error_chain(exc)
        row.update(error=chain[0][0], root=chain[-1][0], message=chain[-1][1][:300],
                   seconds=round(time.monotonic() - t0, 2))


def _no_room(args, rank, world, model, dbo, plain, ids, mask, need, short) -> dict:
    """The plain call's need known (as the autotune measures it): every rank raises
    DeviceMemoryError before the call starts, and a call of half the batch runs after."""
    row: dict = {"case": "no-room", "rank": rank}
    dbo.plain_bytes_per_token = -(-int(need[0] * (1 + MEMORY_MARGIN)) // ids.numel())
    if rank == world - 1:
        row["free"] = short.leave_free(max(1, need[0] // 4), raise_oom=True)
    _call(row, dbo, ids, mask)
    short.release()
    half = ids.shape[0] // 2
    again = dbo(ids[:half], mask[:half])
    row.update(next_split=dbo.last_plan.split, next_matches=_matches(again, plain(ids[:half], mask[:half])))
    row["passed"] = bool(row.get("error") == DeviceMemoryError.__name__ and row["seconds"] <= SLACK_S
                         and row["next_matches"])
    return row


def _no_room_unmeasured(args, rank, world, model, dbo, ids, mask, need, short) -> dict:
    """The plain call's need unknown: the short rank runs out of memory mid-call."""
    row: dict = {"case": "no-room, unmeasured", "rank": rank}
    dbo.plain_bytes_per_token = 0
    if rank == world - 1:
        row["free"] = short.leave_free(max(1, need[0] // 4), raise_oom=True)
    _call(row, dbo, ids, mask)
    short.release()
    if rank == world - 1:
        row["passed"] = row.get("root") == "OutOfMemoryError"
    else:
        # (the root may be the transport's own error where the short rank's exit closed it)
        row["passed"] = bool(CollectiveTimeoutError.__name__ in (row.get("error"), row.get("root"))
                             and row["seconds"] <= args.timeout + SLACK_S)
    return row


def _gather(args: argparse.Namespace, world: int) -> list[dict] | None:
    deadline = time.monotonic() + args.timeout + 15
    paths = [f"{args.json}.rank{r}" for r in range(world)]
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
        time.sleep(0.2)
    rows = []
    for p in paths:
        try:
            rows.extend(json.loads(Path(p).read_text()))
        except (OSError, ValueError):
            return None
    return rows


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[dict]:
    if args.save_checkpoint:
        save_checkpoint(args.config, args.save_checkpoint, args.dtype, device, args.seed, rank)
    model = load_checkpoint(args.checkpoint, args.dtype, device, backend=args.backend)
    use_backend(model, args.backend,
                **backend_kwargs(args.backend, max_tokens_per_rank=args.batch * args.seq))
    ids, mask = (t.to(device) for t in left_padded_prompts(11 + rank, [0, 3] * (args.batch // 2)
                                                               + [0] * (args.batch % 2), args.seq))
    # the last position's logits, as a prefill before decoding keeps
    plain = DBOPrefill(model, SplitConfig(enabled=False), logits_to_keep=1, timeout_s=args.timeout)
    dbo = DBOPrefill(model, prefill_split_config(adaptive=False), logits_to_keep=1, timeout_s=args.timeout)
    short = _Short(model, device)
    rows = []
    with torch.inference_mode():
        for _ in range(2):  # warm: kernels, the allocator's cache
            plain(ids, mask)
            dbo(ids, mask)
        need = all_reduce_max([transient_bytes(lambda: plain(ids, mask), device),
                               transient_bytes(lambda: dbo(ids, mask), device)])
        if device.type != "cuda":  # no device memory to read: stand-in figures
            need = [64 << 20, 96 << 20]
        dbo.wrapper.config = dataclasses.replace(dbo.wrapper.config,
                                                 min_free_bytes=int(need[1] * (1 + MEMORY_MARGIN)))
        rows.append(_fallback(args, rank, world, model, dbo, plain, ids, mask, need, short))
        if rank == 0:
            print(f"fallback: {json.dumps(rows[-1])}", flush=True)
        rows.append(_no_room(args, rank, world, model, dbo, plain, ids, mask, need, short))
        rows.append(_no_room_unmeasured(args, rank, world, model, dbo, ids, mask, need, short))
    return rows


def _table(rows: list[dict]) -> str:
    out = ["| case | rank | outcome | s | passed |", "|---|---|---|---|---|"]
    for r in rows:
        if r["case"] == "no-room" and "next_matches" in r:
            what = (f"{r['error']}: {r.get('message', '')}; next call of half the batch: split "
                    f"{r['next_split']}, match {r['next_matches']}")
            secs = f"{r['seconds']}"
        elif r["case"] == "fallback":
            what = r.get("skipped") or (f"split {r['split']} ({r['reason']}), logits match {r['matches']}; "
                                        f"next call of half the batch: split {r['next_split']}, "
                                        f"match {r['next_matches']}")
            secs = "-"
        else:
            what = (f"{r['error']} ({r['root']}): {r['message']}" if r.get("error") else "returned")
            secs = f"{r['seconds']}"
        out.append(f"| {r['case']} | {r['rank']} | {what} | {secs} | {r.get('passed')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.json = args.json or os.path.join(tempfile.gettempdir(), "dbo_hf_oom.json")
    rank, world, device = init_distributed(args.device)
    code = 1
    try:
        rows = run(args, rank, world, device)
        Path(f"{args.json}.rank{rank}").write_text(json.dumps(rows))
        if rank == 0:
            gathered = _gather(args, world)
            if gathered is None:
                verdict(PROG, False, "a rank wrote no outcome")
            else:
                print(_table(gathered), flush=True)
                doc = {"world": world, "device": args.device, "timeout_s": args.timeout, "rows": gathered}
                Path(args.json).write_text(json.dumps(doc, indent=1))
                ok = all(r.get("passed") or "skipped" in r for r in gathered)
                verdict(PROG, ok, f"{sum(bool(r.get('passed')) for r in gathered)} of {len(gathered)} rows "
                                  f"passed; wrote {args.json}")
                code = 0 if ok else 1
        else:
            code = 0
    except BaseException:  # noqa: BLE001 - printed; the rank ends below, with status 1
        traceback.print_exc()
        code = 1
    finally:
        # case 3 left the group out of step: a teardown would wait on peers that failed (NCCL's
        # ends at its deadline, exit 1), so each rank ends here with its verdict's status
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
