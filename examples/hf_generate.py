"""Greedy decoding of a transformers MoE model loaded expert-parallel: transformers' ``generate()``
with its own ``all_to_all`` expert parallelism beside dbo's ``greedy_generate`` on dbo's backends.

    torchrun --nproc-per-node 2 examples/hf_generate.py          # CPU, gloo: a tiny Qwen3-MoE checkpoint
    torchrun --nproc-per-node 4 examples/hf_generate.py --device cuda --preset qwen3-30b-a3b \\
        --save-checkpoint /tmp/q48 --batch 64 --prompt 512 --new-tokens 64 \\
        --backend copy_engine deepep_ht/deepep_ll

Every rank decodes its own batch of ``--batch`` random prompts of ``--prompt`` tokens for
``--new-tokens`` steps (greedy), first with transformers' ``generate()`` on the checkpoint loaded
with its own ``all_to_all`` implementation (under ``no_grad``, which it needs), then, on the
checkpoint loaded with dbo's implementations, with
:func:`dbo.integrations.transformers.generate.greedy_generate`
per ``--backend``: plain (no split), "DBO prefill" (the prompt as two overlapped ubatches of
sequences, then their caches joined and the decode steps plain: ``greedy_generate``'s default) and
"DBO" (every step overlapped, each ubatch with its own KV cache: ``split_decode=True``). A backend
``PREFILL/DECODE`` (``deepep_ht/deepep_ll``) moves the prompts through the first and the decode
steps through the second (``switch_ep_backend(..., decode_backend=)``). It prints tokens/s per GPU
(new tokens of the batch over the whole call, prefill included; slowest rank; median of ``--steps``
calls after ``--warmup``), the prefill's time (the same call with one new token) and how far each
run's tokens agree with ``generate()``'s: bf16 rounding differs between implementations, and a
near-tie flips a token, after which the sequences part ways.
So the agreement is the share of sequences identical to the end, and the mean share of new tokens
before the first difference; each DBO row gives the same against its plain row too.

``--link GBPS[,LATENCY_US]`` runs dbo's backends under the simulated link (docs/multihost.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_moe  # noqa: E402  (examples/ is on the path: its loading and backend helpers)

from dbo.backends import BACKENDS  # noqa: E402
from dbo.bench.dist import shutdown_distributed  # noqa: E402
from dbo.split import SplitConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--preset", default=None, help="as examples/hf_moe.py (default: tiny on CPU)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--backend", nargs="+", default=None,
                   help="NAME or PREFILL/DECODE (default: all2all copy_engine on CPU, "
                        "copy_engine deepep_ht/deepep_ll on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (CPU 4, CUDA 64)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (CPU 8, CUDA 512)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (CPU 4, CUDA 64)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--checkpoint", default=None, help="DIR: a checkpoint of the preset's model")
    p.add_argument("--save-checkpoint", default=None, help="DIR: write the preset's random checkpoint first")
    p.add_argument("--link", default=None, metavar="GBPS[,LATENCY_US]")
    p.add_argument("--remote-fraction", type=float, default=1.0)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.batch = a.batch or (64 if cuda else 4)
    a.prompt = a.prompt or (512 if cuda else 8)
    a.new_tokens = a.new_tokens or (64 if cuda else 4)
    if min(a.batch, a.prompt, a.new_tokens, a.steps) < 1 or a.warmup < 0:
        p.error("--batch, --prompt, --new-tokens and --steps must be >= 1, --warmup >= 0")
    a.backend = a.backend or (["copy_engine", "deepep_ht/deepep_ll"] if cuda else ["all2all", "copy_engine"])
    a.pairs = []
    for spec in a.backend:
        prefill, _, decode = spec.partition("/")
        for name in (prefill, decode):
            if name and name not in BACKENDS:
                p.error(f"--backend {spec}: unknown backend {name!r}; choose from {sorted(BACKENDS)}")
        if spec.endswith("/"):
            p.error(f"--backend {spec}: give PREFILL/DECODE or one name")
        a.pairs.append((prefill, decode or None))
    if not (a.checkpoint or a.save_checkpoint):
        if cuda:
            p.error("give --checkpoint DIR (or --save-checkpoint DIR to write one)")
        a.save_checkpoint = "hf_generate_ckpt"
    # the helpers of examples/hf_moe.py take its namespace
    base = ["--device", a.device, "--backend", *dict.fromkeys(p for p, _ in a.pairs)]
    for flag, val in (("--preset", a.preset), ("--layers", a.layers), ("--checkpoint", a.checkpoint),
                      ("--save-checkpoint", a.save_checkpoint), ("--link", a.link)):
        if val is not None:
            base += [flag, str(val)]
    base += ["--remote-fraction", str(a.remote_fraction),
             "--max-tokens-per-rank", str(a.batch * a.prompt)]
    return a, hf_moe.parse_args(base)


def timed(fn, steps: int, warmup: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """``fn()``'s median milliseconds on this rank and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        seconds, out = hf_moe.synced_seconds(fn, device)
        times.append(seconds * 1e3)
    return sorted(times)[len(times) // 2], out


def prefill_ms(fn, a: argparse.Namespace, device: torch.device) -> float:
    """The same call with one new token: the prefill (and one sampling), median ms on this rank."""
    return timed(fn, a.steps, 1, device)[0]


def agreement(got: torch.Tensor, want: torch.Tensor, prompt: int) -> tuple[float, float]:
    """(share of sequences identical to the end, mean share of new tokens before the first
    difference)."""
    g, w = got[:, prompt:], want[:, prompt:]
    same = (g == w)
    first = torch.where(same.all(1), torch.full_like(same[:, 0], g.shape[1], dtype=torch.long),
                        (~same).long().argmax(1))
    return same.all(1).float().mean().item(), (first.float() / g.shape[1]).mean().item()


def add_row(rows: list[dict], rank: int, row: dict) -> None:
    """Keep ``row`` and print it at once (rank 0): a run cut short still shows what it measured."""
    rows.append(row)
    if rank == 0:
        vs_plain = (f"; against plain: identical {row['same_plain']:.2f}, before 1st diff "
                    f"{row['prefix_plain']:.2f}" if "same_plain" in row else "")
        print(f"row: {row['run']}: {row['ms']:.1f} ms (prefill {row['prefill_ms']:.1f}), "
              f"{row['tok_s']:,.0f} new tokens/s per GPU, "
              f"identical {row['same']:.2f}, before 1st diff {row['prefix']:.2f}{vs_plain}", flush=True)


def run(a: argparse.Namespace, args: argparse.Namespace, rank: int, world: int,
        device: torch.device) -> list[dict]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from dbo.integrations.transformers.generate import greedy_generate

    config = hf_moe.build_config(args)
    if args.save_checkpoint:
        hf_moe.save_checkpoint(args, config, rank)
    g = torch.Generator().manual_seed(1234 + rank)
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (a.batch, a.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    new = a.batch * a.new_tokens
    rows = []

    cfg = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    ref = hf_moe.timed_load(lambda: AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=args.dtype,
                                                                         distributed_config=cfg),
                            device, "transformers all_to_all").eval()
    with torch.no_grad():  # transformers' own EP fails under inference_mode
        ms, want = timed(lambda m=ref: m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                  max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens),
                         a.steps, a.warmup, device)
        pre_ms = prefill_ms(lambda m=ref: m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                     max_new_tokens=1, min_new_tokens=1), a, device)
    ms, pre_ms = hf_moe.slowest([ms, pre_ms], device)
    add_row(rows, rank, dict(run="transformers generate (all_to_all)", ms=ms, prefill_ms=pre_ms,
                             tok_s=new / ms * 1e3, same=1.0, prefix=1.0))
    del ref
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = hf_moe.load_checkpoint(args, device, expert_parallel=True)
    plain_cfg = SplitConfig(enabled=False)
    dbo_cfg = SplitConfig(prefill_token_threshold=2, decode_token_threshold=2)
    with torch.inference_mode():
        for prefill, decode in a.pairs:
            hf_moe.use_backend(model, prefill, a.batch * a.prompt, args, decode_backend=decode,
                               decode_max_tokens=a.batch)
            label = prefill if decode is None else f"{prefill}/{decode}"
            plain = None
            for name, split, every in (("plain", plain_cfg, False), ("DBO prefill", dbo_cfg, False),
                                       ("DBO", dbo_cfg, True)):
                ms, (got, plan) = timed(lambda split=split, every=every: greedy_generate(
                    model, ids, mask, max_new_tokens=a.new_tokens, config=split, split_decode=every),
                    a.steps, a.warmup, device)
                pre_ms = prefill_ms(lambda split=split: greedy_generate(
                    model, ids, mask, max_new_tokens=1, config=split), a, device)
                same, prefix = agreement(got, want, a.prompt)
                vs_plain = agreement(got, plain, a.prompt) if plain is not None else (1.0, 1.0)
                plain = got if plain is None else plain
                ms, pre_ms, *neg = hf_moe.slowest([ms, pre_ms, -same, -prefix, -vs_plain[0], -vs_plain[1]],
                                                  device)
                add_row(rows, rank, dict(run=f"dbo greedy_generate {label} {name}", ms=ms, prefill_ms=pre_ms,
                                         tok_s=new / ms * 1e3, same=-neg[0], prefix=-neg[1],
                                         same_plain=-neg[2], prefix_plain=-neg[3], split=str(plan)))
    return rows


def main(argv: list[str] | None = None) -> int:
    a, args = parse_args(argv)
    if any(b and BACKENDS[b].gpu_only for pair in a.pairs for b in pair) and a.device != "cuda":
        raise SystemExit(f"--backend {a.backend}: DeepEP backends need --device cuda")
    rank, world, device = hf_moe.init_distributed(a.device)
    finished = False
    try:
        rows = run(a, args, rank, world, device)
        if rank == 0:
            print(f"\n{args.checkpoint}: batch {a.batch} x prompt {a.prompt} + {a.new_tokens} new tokens "
                  f"per rank, {world} ranks, {args.dtype}; ms per call (prefill included), slowest rank; "
                  "prefill ms = the same call with one new token; "
                  "tokens/s per GPU = new tokens / time; agreement with generate(): sequences "
                  "identical to the end / mean share of new tokens before the first difference\n")
            print("| run | ms | prefill ms | new tokens/s per GPU | identical | before 1st diff | "
                  "identical to plain |")
            print("|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['run']} | {r['ms']:.1f} | {r['prefill_ms']:.1f} | {r['tok_s']:,.0f} "
                      f"| {r['same']:.2f} "
                      f"| {r['prefix']:.2f} | {r.get('same_plain', 1.0):.2f} |")
            if a.json:
                Path(a.json).write_text(json.dumps({"world": world, "batch": a.batch, "prompt": a.prompt,
                                                    "new_tokens": a.new_tokens, "rows": rows}, indent=1))
        finished = True
        return 0
    finally:
        shutdown_distributed(wait_for_peers=finished)  # a rank that failed skips the barrier


if __name__ == "__main__":
    sys.exit(main())
