"""Dual-batch overlap on a small MoE transformer: the same numbers as the plain forward, a trace.

    torchrun --nproc-per-node 2 examples/moe_overlap.py                     # CPU, gloo
    torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --dtype bfloat16 \\
        --backend deepep_ll --tokens 128 --hidden 2048                       # GPUs, NCCL

Every rank builds the same model (dbo.bench.overlap.model: per layer an attention stand-in, a top-k
router, routed experts spread over the ranks behind a prepare/finalize backend, a shared
expert) and its own batch. It runs the plain forward and the overlapped one (dbo.DBOWrapper: one
ubatch's all-to-all in flight while another computes), checks that they agree, prints both step
times and a verdict (exit code 1 if they differ), and rank 0 writes the schedule of one
overlapped step as a Perfetto trace (open it at https://ui.perfetto.dev). Where nothing was split
(``DBO_DISABLE=1``) both runs are plain: the verdict says so and no trace is written.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dbo
from dbo.backends import BACKENDS, make_backend
from dbo.bench import cli
from dbo.bench.dist import distributed
from dbo.bench.overlap.model import BenchModel, LayerDims
from dbo.bench.timing import median_ms
from dbo.experts import SwiGLUExperts, relative_error
from dbo.peers.collectives import all_reduce_max
from dbo.split import SplitConfig

PROG = "moe_overlap.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="naive")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--uneven", action="store_true", help="fewer tokens on the higher ranks")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=256, help="per expert")
    p.add_argument("--experts", type=int, default=8, help="routed experts over all ranks")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ubatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps of each forward")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trace", default="moe_overlap.trace.json", help="rank 0's trace ('' for none)")
    a = p.parse_args(argv)
    cli.check_at_least(p, a, 1, "tokens", "hidden", "intermediate", "experts", "topk", "layers", "steps")
    cli.check_at_least(p, a, 2, "ubatches")  # one ubatch computes while another communicates
    cli.check_at_least(p, a, 0, "warmup")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk}: must be <= --experts ({a.experts})")
    cli.check_backend_fits(p, a.backend, device=a.device, dtype=a.dtype)
    cli.check_experts_split(p, a.experts, cli.env_world_size())  # before the group: every rank exits 2
    cli.check_device(p, a.device)
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with distributed(args.device) as (rank, world, device):  # torchrun's group, torn down after
        return run(args, rank, world, device)


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    dtype = DTYPES[args.dtype]
    tokens = args.tokens - rank * args.tokens // (2 * world) if args.uneven else args.tokens
    dims = LayerDims(hidden=args.hidden, intermediate=args.intermediate,
                     shared_intermediate=args.intermediate, num_experts=args.experts,
                     topk=args.topk, attn_width=2 * args.hidden, layers=args.layers, dtype=dtype,
                     attn_yield=True)
    backend = make_backend(args.backend, None, hidden=args.hidden, num_experts=args.experts,
                           topk=args.topk, max_tokens_per_rank=args.tokens, dtype=dtype,
                           device=device)
    model = BenchModel(dims, rank, world, device).use(backend, SwiGLUExperts())
    x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(rank + 1)).to(device, dtype)
    # adaptive=False: overlap every call, to compare it with the serial step (left on, the
    # default, the wrapper times both on its first calls and keeps the faster)
    split = SplitConfig(num_ubatches=args.ubatches, decode_token_threshold=32,
                        prefill_token_threshold=32, adaptive=False)
    overlapped = dbo.DBOWrapper(model, split)
    trace = dbo.Trace()
    with torch.inference_mode():
        ref, out = model(x), overlapped(x, trace=trace)
        plan = overlapped.last_plan  # plain where nothing was split (DBO_DISABLE=1, for one)
        # Each layer on the plain run's input too: in bf16 on GPUs a ubatch's matmuls round
        # unlike the whole batch's, and a one-ulp flip of a later layer's top-k tie changes a
        # token entirely, so bf16 is judged layer by layer (float32 end to end as well).
        layer_err, h = [], x
        for i in range(args.layers):
            want = model.layer(i, h)
            got = dbo.DBOWrapper(lambda t, i=i: model.layer(i, t), split)(h)
            layer_err.append(relative_error(got, want))
            h = want
        serial_ms = median_ms(lambda: model(x), steps=args.steps, warmup=args.warmup, device=device)
        dbo_ms = median_ms(lambda: overlapped(x), steps=args.steps, warmup=args.warmup,
                           device=device)
    serial_ms, dbo_ms, err, worst = all_reduce_max(
        [serial_ms, dbo_ms, relative_error(out, ref), max(layer_err)])
    limit = TOLERANCE[dtype]
    ok = worst <= limit and (err <= limit or dtype != torch.float32)
    if rank == 0:
        print(f"dbo moe_overlap: backend={args.backend} world={world} device={device.type} "
              f"dtype={args.dtype} tokens/rank={args.tokens}{' (uneven)' if args.uneven else ''} "
              f"layers={args.layers} experts={args.experts} top-{args.topk}")
        print(f"plan (rank 0): {plan}")
        print(f"serial: {serial_ms:.2f} ms/step   dbo{'' if plan.split else ' (ran plain)'}: "
              f"{dbo_ms:.2f} ms/step   (median of {args.steps} steps, slowest rank)")
        errors = f"rel err end to end {err:.1e}, worst layer {worst:.1e}, limit {limit:g}"
        if not plan.split:  # no overlapped step to compare or to trace
            why = (f"no step was overlapped ({plan.reason.value}: {plan.detail}): both runs were "
                   f"plain and {'agree' if ok else 'differ'} ({errors}); no overlapped trace written")
        else:
            where = "no trace written"
            if args.trace:
                where = f"trace of one overlapped step in {trace.write_chrome(args.trace)}"
            why = f"DBO output {'matches' if ok else 'differs from'} serial output ({errors}); {where}"
        cli.verdict(PROG, ok, why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
