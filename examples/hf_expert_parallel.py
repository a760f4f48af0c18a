"""A transformers MoE model made expert-parallel by dbo, its prefill run as overlapped ubatches.

    torchrun --nproc-per-node 2 examples/hf_expert_parallel.py                     # CPU, gloo
    torchrun --nproc-per-node 2 examples/hf_expert_parallel.py --family mixtral --backend naive

Every rank builds the same tiny random-weight model from its config alone (Qwen3-MoE, Mixtral or
DeepSeek-V3; nothing is downloaded) and converts it expert-parallel: each MoE layer keeps this
rank's share of the experts and sends tokens to the other ranks' experts through a dbo backend.
Each rank then prefills its own batch twice, plainly and with ``DBOPrefill`` (the batch cut into
two ubatches of sequences: while one ubatch's all-to-all is in flight the other computes), and
checks that both give the same logits.

With transformers >= 5.23 a checkpoint loads expert-parallel directly, each rank reading only its
experts: ``AutoModelForCausalLM.from_pretrained(DIR, distributed_config=ep_distributed_config(
"all2all"))`` (``dbo.integrations.transformers.ep``); the prefill is the same.
``python -m dbo.bench hf-prefill`` times both ways on every backend.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dbo import cli
from dbo.backends import cpu_backends
from dbo.experts import relative_error
from dbo.integrations.transformers import (
    DBOPrefill,
    convert_to_expert_parallel,
    prefill_logits,
    prefill_split_config,
)
from dbo.integrations.transformers.presets import TINY_FAMILIES, tiny_random_model
from dbo.peers.collectives import all_reduce_max
from dbo.peers.process_group import distributed
from dbo.split import SplitReason

PROG = "hf_expert_parallel.py"
EXPERTS = 8  # the tiny models' routed experts per MoE layer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=TINY_FAMILIES, default="qwen3_moe", help="(default: qwen3_moe)")
    p.add_argument("--backend", choices=cpu_backends(), default="all2all", help="(default: all2all)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank, 2 or more (default: 4)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default: 16)")
    args = p.parse_args(argv)
    cli.check_at_least(p, args, 2, "batch")  # two ubatches of whole sequences
    cli.check_at_least(p, args, 1, "seq")
    world = cli.env_world_size()
    if EXPERTS % world:
        p.error(f"{world} ranks: the model's {EXPERTS} experts do not split evenly over them; "
                "run 1, 2, 4 or 8 ranks")
    return args


def run(args: argparse.Namespace, rank: int) -> int:
    model = tiny_random_model(args.family, seed=0)  # seeded: the same weights on every rank
    convert_to_expert_parallel(model, backend=args.backend)  # keeps this rank's experts only
    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
    # adaptive=False: overlap every call, to check it against the plain forward (left on, the
    # default, DBOPrefill times plain and overlapped on its first calls and keeps the faster)
    prefill = DBOPrefill(model, prefill_split_config(min_sequences=2, adaptive=False))
    with torch.inference_mode():
        plain = prefill_logits(model, ids)
        overlapped = prefill(ids)
    # the worst rank's numbers: every rank reaches the same verdict
    plan = prefill.last_plan  # plain where nothing was split (DBO_DISABLE=1, for one)
    err, unsplit = all_reduce_max([relative_error(overlapped, plain), float(not plan.split)])
    disabled = plan.reason is SplitReason.DISABLED  # DBO turned off on purpose: both runs plain
    ok = err <= 1e-4 and (not unsplit or disabled)
    why = (f"DBOPrefill's logits {'equal' if err <= 1e-4 else 'differ from'} the plain forward's on every "
           f"rank (rel err {err:.1e}, tolerance 1e-4; {args.family}, backend {args.backend}"
           f"{', but a rank ran it unsplit' if unsplit and not disabled else ''})")
    if disabled:
        why = f"nothing was overlapped ({plan.reason.value}: {plan.detail}): both runs were plain; {why}"
    return cli.verdict(PROG, ok, why) if rank == 0 else int(not ok)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with distributed("cpu") as (rank, _, _):  # torchrun's gloo group, torn down after
        return run(args, rank)


if __name__ == "__main__":
    sys.exit(cli.run_main(PROG, main))
