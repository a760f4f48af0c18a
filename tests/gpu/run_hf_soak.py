"""A soak of the transformers path: ``DBOPrefill`` and ``greedy_generate`` calls of random sizes
for a while, on a checkpoint loaded expert-parallel with a dbo backend, and whether the process
stays healthy (memory flat, no error, tokens/s steady).

    torchrun --nproc-per-node 2 tests/gpu/run_hf_soak.py                  # CPU, gloo: tiny Qwen3-MoE
    torchrun --nproc-per-node 2 tests/gpu/run_hf_soak.py --device cuda --duration-s 1500 --json soak.json

The checkpoint: ``--checkpoint DIR`` (or ``--save-checkpoint DIR`` to write ``--preset`` there
first), else ``--preset``'s (default: Qwen3-30B-A3B at full size on CUDA, the tiny Qwen3-MoE on
CPU) written once with random weights to a directory under the system's temp dir, named after
the preset, layers and dtype, and reused while it holds a ``config.json``
(:mod:`dbo.bench.hf.model`). Every rank loads it with ``from_pretrained(...,
distributed_config=ep_distributed_config(BACKEND))`` and sizes the backend for the largest call.

First, one check: a ``DBOPrefill`` (split from 2 sequences) against the plain prefill's logits,
and ``greedy_generate`` overlapped against plain (float32: the same tokens; bfloat16: the first
new token for at least 75% of the sequences). Then, for ``--duration-s`` (at most
``--max-calls`` calls), ``DBOPrefill`` calls (the last position's logits) and ``greedy_generate``
calls (``--new-tokens``) in turn, each on left-padded prompts with attention masks: a batch drawn
from ``--batches``, each sequence's length from ``--min-len..--max-len``. The sizes come from
``--seed`` alone, so every rank makes the same calls (the MoE layers are collective); the tokens
differ per rank. The soak opens with the largest call of each kind, so that the allocator's cache
reaches its high-water mark within the warm-up (``--warmup-calls``). After each call every rank
reports, through one all-reduce: whether it failed, which call it made, its seconds and memory
(``torch.cuda.memory_allocated`` / ``memory_reserved`` and the call's peak; None on the CPU) and
its host RSS. A failed call is recorded (and its traceback printed by the rank that raised it);
the soak goes on after a call that failed on every rank (``--max-errors`` at most) and stops
where the ranks are out of step: a call that failed on some ranks only, ranks that made
different calls, or a check that could not complete.

Rank 0 prints the summary (``hf_soak_calls.py``): calls and errors; memory after the warm-up per
rank (min, max, (max - min) / max, flat within 1%); host RSS after the warm-up and at the end
(not judged); tokens/s per kind over the first and the last tenth of its calls after the warm-up
(random sizes: read them as a trend, not a figure); then one verdict line, and writes ``--json``
(as it goes too). Exit status: 0 pass, 1 an error, a failed check, ranks out of step or (CUDA)
memory not flat; 2 a bad option; 3 transformers without its expert-parallel interface.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch
from hf_soak_calls import CallSpec, format_summary, soak_specs, soak_verdict, summarize  # beside it

from dbo.bench.cli import ArgumentParser, check_at_least, verdict
from dbo.bench.dist import init_distributed, shutdown_distributed
from dbo.bench.hf.args import (
    add_model_arguments,
    backend_name,
    check_backends,
    check_model_arguments,
    default_checkpoint,
)
from dbo.bench.hf.load import rss_mib
from dbo.bench.hf.model import (
    backend_kwargs,
    load_checkpoint,
    peak_gib,
    reset_layers,
    reset_peak,
    save_checkpoint,
)
from dbo.bench.hf.prefill_table import logits_match
from dbo.experts import relative_error
from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config, use_backend
from dbo.integrations.transformers.generate import greedy_generate
from dbo.peers.collectives import all_reduce_max
from dbo.peers.watchdog import collective_timeout
from dbo.split import SplitConfig
from dbo.testing.faults import error_chain
from dbo.testing.hf import left_padded_prompts

PROG = "run_hf_soak.py"
JSON_EVERY_S = 5.0  # rank 0 rewrites --json at most this often while the soak runs


def _call_rank(text: str) -> tuple[int, int | None]:
    """argparse type of ``--inject-error``: ``CALL`` or ``CALL:RANK``."""
    call, _, rank = text.partition(":")
    try:
        return int(call), int(rank) if rank else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want CALL or CALL:RANK (integers)") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--backend", type=backend_name, default=None,
                   help="dbo backend of the expert-parallel load (default: copy_engine on CUDA, "
                        "all2all on CPU)")
    p.add_argument("--duration-s", type=float, default=None, help="seconds of calls (CUDA 1800, CPU 20)")
    p.add_argument("--max-calls", type=int, default=None, help="stop after this many calls (default: none)")
    p.add_argument("--min-len", type=int, default=None, help="shortest prompt (CUDA 64, CPU 8)")
    p.add_argument("--max-len", type=int, default=None, help="longest prompt (CUDA 4096, CPU 64)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8],
                   help="sequences per call, one drawn per call (default: 1 2 4 8)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="greedy_generate's new tokens (CUDA 16, CPU 4)")
    p.add_argument("--warmup-calls", type=int, default=5,
                   help="calls left out of the memory and tokens/s figures (default: 5)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="each call's wait for a peer, and the check's after it (default: 120)")
    p.add_argument("--max-errors", type=int, default=3,
                   help="stop after this many failed calls (default: 3)")
    p.add_argument("--adaptive", action="store_true",
                   help="DBOPrefill with the online choice of plain or overlapped per size (default: "
                        "every call of 2+ sequences overlapped)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="greedy_generate(cuda_graph=True): the decode steps from a static cache, replayed "
                        "from a CUDA graph captured per call (on the CPU the same steps run eagerly)")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="turn torch's cuDNN attention backend off (torch.backends.cuda.enable_cudnn_sdp"
                        "(False)): its plan cache keeps an entry per attention shape for the process's "
                        "life, host memory that grows with every new prompt length and KV length")
    p.add_argument("--inject-error", type=_call_rank, default=None, metavar="CALL[:RANK]",
                   help="testing the runner: RANK (default: every rank) raises after call CALL returned")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.duration_s = a.duration_s if a.duration_s is not None else (1800.0 if cuda else 20.0)
    a.min_len = a.min_len or (64 if cuda else 8)
    a.max_len = a.max_len or (4096 if cuda else 64)
    a.new_tokens = a.new_tokens or (16 if cuda else 4)
    check_at_least(p, a, 1, "batches", "min_len", "max_len", "new_tokens", "max_errors")
    check_at_least(p, a, 0, "warmup_calls")
    if a.max_calls is not None:
        check_at_least(p, a, 1, "max_calls")
    for name in ("duration_s", "timeout_s"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0")
    if a.max_len < a.min_len:
        p.error(f"--max-len {a.max_len}: must be >= --min-len {a.min_len}")
    if importlib.util.find_spec("transformers") is None or \
            importlib.util.find_spec("transformers.distributed.expert_parallel") is None:
        print("SKIP: needs transformers >= 5.23 (its expert-parallel interface) and accelerate", flush=True)
        raise SystemExit(3)
    check_model_arguments(p, a)
    default_checkpoint(a, "soak")  # the preset written once, reused while its config.json is there
    positions = getattr(a.config, "max_position_embeddings", None)
    if positions is not None and a.max_len + a.new_tokens > positions:
        p.error(f"--max-len {a.max_len} + --new-tokens {a.new_tokens}: over the model's "
                f"{positions} positions")
    a.backend = a.backend or ("copy_engine" if cuda else "all2all")
    check_backends(p, [a.backend], a)
    return a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(args: argparse.Namespace, spec: CallSpec, i: int, rank: int, vocab: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(ids [batch, seq] int64, mask)`` of call ``i``: its own tokens, the shared
    padding."""
    ids, mask = left_padded_prompts(args.seed * 1_000_003 + i * 7919 + rank, spec.pads, spec.seq, vocab)
    return ids.to(device), mask.to(device)


def check_dbo_against_plain(args: argparse.Namespace, model: torch.nn.Module, rank: int,
                            device: torch.device) -> dict:
    """One ``DBOPrefill`` call (split from 2 sequences) against the plain prefill, and one overlapped
    ``greedy_generate`` against a plain one, on a batch of up to 4 prompts of up to 512 tokens;
    the worst rank's figures, ``ok`` and ``why``."""
    rng = random.Random(args.seed + 1)
    lengths = [rng.randint(args.min_len, min(args.max_len, max(args.min_len, 512)))
               for _ in range(max(2, min(4, max(args.batches))))]
    spec = CallSpec("check", max(lengths), tuple(max(lengths) - n for n in lengths))
    ids, mask = _prompts(args, spec, -1, rank, model.config.vocab_size, device)
    fixed = DBOPrefill(model, prefill_split_config(adaptive=False), logits_to_keep=1,
                       timeout_s=args.timeout_s)
    got, want = fixed(ids, mask).float(), prefill_logits(model, ids, mask, logits_to_keep=1).float()
    rel, agree = relative_error(got, want), (got[:, -1].argmax(-1) == want[:, -1].argmax(-1)).float().mean()
    with collective_timeout(args.timeout_s):
        overlapped = SplitConfig(prefill_token_threshold=2, decode_token_threshold=2)
        tokens, plan = greedy_generate(model, ids, mask, max_new_tokens=args.new_tokens,
                                       config=overlapped, cuda_graph=args.cuda_graph)
        plain, _ = greedy_generate(model, ids, mask, max_new_tokens=args.new_tokens,
                                   config=SplitConfig(enabled=False))
    same = (tokens == plain).all(1).float().mean()
    first = (tokens[:, spec.seq] == plain[:, spec.seq]).float().mean()
    split = fixed.last_plan.split and plan.split
    rel, neg_agree, neg_same, neg_first, neg_split = all_reduce_max(
        [float(rel), -float(agree), -float(same), -float(first), -float(split)],
        phase="the soak's first check")
    agree, same, first, split = -neg_agree, -neg_same, -neg_first, -neg_split > 0
    prefill_ok = logits_match(rel, agree, args.dtype)
    generate_ok = same == 1.0 if args.dtype == torch.float32 else first >= 0.75
    why = (f"prefill {spec.batch}x{spec.seq}: rel err {rel:.2e}, top-1 agree {agree:.2f}; "
           f"generate {args.new_tokens} tokens: identical {same:.2f}, first token {first:.2f}"
           + ("" if split else "; NOT split: nothing overlapped was checked"))
    return {"batch": spec.batch, "seq": spec.seq, "prefill_rel_err": rel, "prefill_top1_agree": agree,
            "prefill_ok": prefill_ok, "generate_identical": same, "generate_first_token": first,
            "generate_ok": generate_ok, "split": split, "ok": bool(prefill_ok and generate_ok and split),
            "why": why}


def _exchange(world: int, rank: int, spec: CallSpec, seconds: float, elapsed: float, failed: bool,
              device: torch.device) -> dict:
    """Every rank's figures of the call just made, through one all-reduce MAX (each rank's in
    its own slots, -1 elsewhere)."""
    cuda = device.type == "cuda"
    mine = [float(failed),
            float(torch.cuda.memory_allocated(device)) if cuda else -1.0,
            float(torch.cuda.memory_reserved(device)) if cuda else -1.0,
            (peak_gib(device) or 0.0) * 2**30 if cuda else -1.0,
            rss_mib()]
    slots = [-1.0] * (len(mine) * world)
    for k, value in enumerate(mine):
        slots[k * world + rank] = value
    code = float(spec.code)
    got = all_reduce_max([code, -code, seconds, elapsed, *slots], phase="the soak's check after a call")
    per_rank = [got[4 + k * world: 4 + (k + 1) * world] for k in range(len(mine))]
    return {"same_call": got[0] == -got[1], "seconds": got[2], "elapsed": got[3],
            "failed_ranks": [r for r in range(world) if per_rank[0][r] > 0],
            "allocated": per_rank[1] if cuda else None, "reserved": per_rank[2] if cuda else None,
            "peak_allocated": per_rank[3] if cuda else None, "rss_mib": per_rank[4]}


def _call(args: argparse.Namespace, model: torch.nn.Module, prefill: DBOPrefill, spec: CallSpec,
          ids: torch.Tensor, mask: torch.Tensor) -> tuple[bool, int]:
    """Make the call; ``(split, tokens)``: whether its prefill ran as ubatches, and the tokens
    its rate counts (prefill: the prompts' real tokens; generate: the new ones)."""
    with collective_timeout(args.timeout_s):
        if spec.kind == "prefill":
            out = prefill(ids, mask)
            del out
            return bool(prefill.last_plan.split), int(mask.sum())
        out, plan = greedy_generate(model, ids, mask, max_new_tokens=args.new_tokens,
                                    cuda_graph=args.cuda_graph)
        del out
        return bool(plan.split), spec.batch * args.new_tokens


def soak(args: argparse.Namespace, model: torch.nn.Module, rank: int, world: int, device: torch.device,
         on_call) -> tuple[list[dict], str | None, bool]:
    """The soak's calls until the duration, ``--max-calls`` or a stop; ``(calls, why it stopped
    early or None, whether the ranks are still in step)``. ``on_call(record)`` after each call."""
    prefill = DBOPrefill(model, prefill_split_config(adaptive=args.adaptive), logits_to_keep=1,
                         timeout_s=args.timeout_s)
    calls: list[dict] = []
    t0 = time.perf_counter()
    for i, spec in enumerate(soak_specs(args.seed, args.batches, args.min_len, args.max_len)):
        ids, mask = _prompts(args, spec, i, rank, model.config.vocab_size, device)
        _sync(device)
        reset_peak(device)
        start = time.perf_counter()
        split, tokens, error = None, 0, None
        try:
            split, tokens = _call(args, model, prefill, spec, ids, mask)
            _sync(device)
            if args.inject_error is not None and args.inject_error[0] == i \
                    and args.inject_error[1] in (None, rank):
                raise RuntimeError(f"injected after call {i} (--inject-error)")
        except Exception as exc:  # noqa: BLE001 - recorded, and the peers told
            error = [list(link) for link in error_chain(exc)]
            print(f"rank {rank}: call {i} ({spec.kind} {spec.batch}x{spec.seq}) failed:\n"
                  + traceback.format_exc(), file=sys.stderr, flush=True)
            reset_layers(model)  # the failed call's per-ubatch state
        seconds = time.perf_counter() - start
        del ids, mask
        try:
            seen = _exchange(world, rank, spec, seconds, time.perf_counter() - t0, error is not None, device)
        except Exception as exc:  # noqa: BLE001 - a peer gone or stuck: nothing more to run together
            return calls, f"the check after call {i} did not complete ({type(exc).__name__}: {exc})", False
        record = {"i": i, "kind": spec.kind, "batch": spec.batch, "seq": spec.seq, "tokens": tokens,
                  "new_tokens": args.new_tokens if spec.kind == "generate" else 0, "split": split,
                  "seconds": seen["seconds"], "tokens_s": tokens / seen["seconds"] if not seen["failed_ranks"]
                  else None, **{k: seen[k] for k in ("allocated", "reserved", "peak_allocated", "rss_mib")},
                  "error": error, "failed_ranks": seen["failed_ranks"]}
        calls.append(record)
        on_call(record)
        failed = seen["failed_ranks"]
        if not seen["same_call"]:
            return calls, f"call {i}: the ranks made different calls (out of step)", False
        if failed and len(failed) < world:
            return calls, f"call {i} failed on rank(s) {failed} only (out of step)", False
        if sum(1 for c in calls if c["failed_ranks"]) >= args.max_errors:
            return calls, f"{args.max_errors} calls failed (--max-errors)", True
        if seen["elapsed"] >= args.duration_s or len(calls) >= (args.max_calls or float("inf")):
            return calls, None, True
    raise AssertionError("soak_specs is endless")


def _progress(record: dict, warmup_calls: int) -> str | None:
    """Rank 0's line for a call: the first ones, every 10th, and every failed one."""
    i = record["i"]
    if i >= warmup_calls + 5 and i % 10 and not record["failed_ranks"]:
        return None
    mem = "" if record["allocated"] is None else (
        f", allocated {max(record['allocated']) / 2**30:.2f} GiB, reserved "
        f"{max(record['reserved']) / 2**30:.2f} GiB (fullest rank)")
    rate = "FAILED on ranks " + str(record["failed_ranks"]) if record["failed_ranks"] else \
        f"{record['tokens_s']:,.0f} tokens/s"
    return (f"call {i} {record['kind']} {record['batch']}x{record['seq']}: {record['seconds']:.2f} s, "
            f"{rate}{mem}")


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> tuple[int, bool]:
    """Load, check, soak, report; ``(exit status, whether the ranks ended in step)``."""
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.save_checkpoint:
        save_checkpoint(args.config, args.save_checkpoint, args.dtype, device, args.seed, rank)
    model = load_checkpoint(args.checkpoint, args.dtype, device, backend=args.backend)
    use_backend(model, args.backend, **backend_kwargs(
        args.backend, max_tokens_per_rank=max(args.batches) * args.max_len, link=args.link))
    label = (f"{world} ranks, {args.device}, {str(args.dtype).removeprefix('torch.')}, dbo_{args.backend}, "
             f"{args.checkpoint}, batches {args.batches}, lengths {args.min_len}..{args.max_len}, "
             f"{args.new_tokens} new tokens")
    doc: dict = {"world": world, "device": args.device, "dtype": str(args.dtype).removeprefix("torch."),
                 "backend": args.backend, "checkpoint": args.checkpoint, "batches": args.batches,
                 "min_len": args.min_len, "max_len": args.max_len, "new_tokens": args.new_tokens,
                 "warmup_calls": args.warmup_calls, "duration_s": args.duration_s, "seed": args.seed,
                 "adaptive": args.adaptive, "cuda_graph": args.cuda_graph,
                 "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled()}
    written = [0.0]

    def write(final: bool = False) -> None:
        if rank == 0 and args.json and (final or time.monotonic() - written[0] >= JSON_EVERY_S):
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1))
            written[0] = time.monotonic()

    with torch.inference_mode():
        doc["check"] = check_dbo_against_plain(args, model, rank, device)
        if rank == 0:
            print(f"DBO against plain: {'ok' if doc['check']['ok'] else 'FAILED'}: {doc['check']['why']}",
                  flush=True)
        doc["calls"] = []

        def on_call(record: dict) -> None:
            doc["calls"].append(record)
            line = _progress(record, args.warmup_calls)
            if rank == 0 and line:
                print(line, flush=True)
            write()

        t0 = time.perf_counter()
        calls, stopped, in_step = soak(args, model, rank, world, device, on_call)
        seconds = time.perf_counter() - t0
    summary = summarize(calls, world=world, warmup_calls=args.warmup_calls)
    ok, why = soak_verdict(summary, doc["check"], stopped, judge_memory=device.type == "cuda")
    doc.update(seconds=seconds, stopped=stopped, summary=summary, ok=ok, why=why)
    write(final=True)
    if rank == 0:
        print("\n" + format_summary(summary, doc["check"], seconds=seconds, warmup_calls=args.warmup_calls,
                                    label=label) + "\n", flush=True)
        verdict(PROG, ok, why + (f"; wrote {args.json}" if args.json else ""))
    reset_layers(model)
    return (0 if ok else 1), in_step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    in_step = False
    try:
        code, in_step = run(args, rank, world, device)
    finally:
        shutdown_distributed(wait_for_peers=in_step)
    return code


if __name__ == "__main__":
    sys.exit(main())
