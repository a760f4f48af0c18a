"""Dual-batch overlap on a small MoE transformer: the same numbers as the plain forward, a trace.

    torchrun --nproc-per-node 2 examples/moe_overlap.py                     # CPU, gloo
    torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --dtype bfloat16 \\
        --backend deepep_ll --tokens 128 --hidden 2048                       # GPUs, NCCL

Every rank builds the same model (per layer an attention stand-in, a top-k router, routed experts
spread over the ranks behind a prepare/finalize backend, a shared expert) and its own batch. It
runs the plain forward and the overlapped one (dbo.DBOWrapper: one ubatch's all-to-all in flight
while another computes), checks that they agree, prints both step times and a verdict (exit code
1 if they differ), and rank 0 writes the schedule of one overlapped step as a Perfetto trace
(open it at https://ui.perfetto.dev). Where nothing was split (DBO_DISABLE=1) both runs are
plain: the verdict says so and no trace is written. On CPU the all-to-all takes the same cores as
the compute: the times there show what the schedule costs, not what it hides, and the run shows
correctness only.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

import dbo
from dbo import cli
from dbo.backends import BACKENDS, describe_backend, make_backend
from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights, relative_error
from dbo.moe import MoEKernel, PrepareAndFinalize, topk_route
from dbo.overlap import mask_current_padding
from dbo.peers.collectives import all_reduce_max
from dbo.peers.process_group import distributed
from dbo.split import SplitConfig

PROG = "moe_overlap.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="naive",
                   help=", ".join(describe_backend(n) for n in sorted(BACKENDS)
                                  if not BACKENDS[n].run_on_gpus))
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
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each forward first")
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
    if a.trace:
        cli.check_writable_file(p, "--trace", a.trace)
    # at least the tokens in, out and dispatched (topk copies), before anything is built
    need = a.tokens * a.hidden * DTYPES[a.dtype].itemsize * (2 + a.topk)
    cli.check_memory_fits(p, f"--tokens {a.tokens} (--hidden {a.hidden})", need, a.device)
    return a


class MoEModel:
    """``layers`` x (attention stand-in, MoE block) on token-major ``[tokens, hidden]``
    activations, one set of weights for every layer (the same on every rank, each rank holding
    its share of the routed experts) and a :class:`dbo.moe.MoEKernel` per layer around
    ``backend``."""

    def __init__(self, args: argparse.Namespace, backend: PrepareAndFinalize, rank: int, world: int,
                 device: torch.device, dtype: torch.dtype):
        h, i = args.hidden, args.intermediate
        gen = torch.Generator().manual_seed(0)

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) * shape[0] ** -0.5).to(device, dtype)

        self.topk, self.num_experts = args.topk, args.experts
        self.w_in, self.w_out = weight(h, 2 * h), weight(2 * h, h)  # the attention stand-in
        self.router = weight(h, args.experts)
        self.shared_w1, self.shared_w2 = weight(h, 2 * i), weight(i, h)
        self.w1, self.w2 = (local_expert_weights(w, rank, world).to(device)
                            for w in make_expert_weights(args.experts, h, i, dtype=dtype))
        self.kernels = [MoEKernel(backend, SwiGLUExperts(), shared_experts=self.shared_expert)
                        for _ in range(args.layers)]

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:  # runs while the combine is in flight
        gate, up = (x @ self.shared_w1).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.shared_w2

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        with dbo.dbo_region("attention"):
            a = F.gelu(F.rms_norm(x, x.shape[1:]) @ self.w_in)
            dbo.dbo_yield()  # the other ubatch's attention, or its all-to-all, goes on meanwhile
            x = x + a @ self.w_out
        h = F.rms_norm(x, x.shape[1:])
        kernel = self.kernels[i]
        ids_dtype = kernel.prepare_finalize.topk_indices_dtype() or torch.int32
        weights, ids = topk_route(h @ self.router, self.topk, ids_dtype=ids_dtype)
        ids, weights = mask_current_padding(ids, weights)  # a split forward's padding: no expert
        return x + kernel(h, self.w1, self.w2, weights, ids, global_num_experts=self.num_experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.kernels)):
            x = self.layer(i, x)
        return x


def step_ms(fn, steps: int, warmup: int) -> float:
    """Mean milliseconds of one call of ``fn``; every rank calls it as often (each call talks to
    the peers)."""
    for _ in range(warmup):
        fn()
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.timeit(steps).mean * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with distributed(args.device) as (rank, world, device):  # torchrun's group, torn down after
        return run(args, rank, world, device)


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    dtype = DTYPES[args.dtype]
    tokens = args.tokens - rank * args.tokens // (2 * world) if args.uneven else args.tokens
    backend = make_backend(args.backend, None, hidden=args.hidden, num_experts=args.experts,
                           topk=args.topk, max_tokens_per_rank=args.tokens,
                           num_ubatches=args.ubatches, dtype=dtype, device=device)
    model = MoEModel(args, backend, rank, world, device, dtype)
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
        serial_ms = step_ms(lambda: model(x), args.steps, args.warmup)
        dbo_ms = step_ms(lambda: overlapped(x), args.steps, args.warmup)
    serial_ms, dbo_ms, err, worst = all_reduce_max(
        [serial_ms, dbo_ms, relative_error(out, ref), max(layer_err)])
    limit = TOLERANCE[dtype]
    ok = worst <= limit and (err <= limit or dtype != torch.float32)
    if rank == 0:
        print(f"dbo moe_overlap: backend={args.backend} world={world} device={device.type} "
              f"dtype={args.dtype} tokens/rank={args.tokens}{' (uneven)' if args.uneven else ''} "
              f"layers={args.layers} experts={args.experts} top-{args.topk} ubatches={args.ubatches}")
        print(f"plan (rank 0): {plan}")
        print(f"serial: {serial_ms:.2f} ms/step   dbo{'' if plan.split else ' (ran plain)'}: "
              f"{dbo_ms:.2f} ms/step   (mean of {args.steps} steps, slowest rank)")
        if device.type == "cpu" and plan.split:
            print("on CPU the all-to-all takes the same cores as the compute, so nothing overlaps: "
                  "these times show what the schedule costs, not what DBO hides; this run shows "
                  "that DBO gives the plain output (--device cuda shows the overlap)")
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
    sys.exit(cli.run_main(PROG, main))
