"""Whether an overlapped prefill's logits differ from plain's by rounding or by a fault.

    python tools/probes/split_noise.py --device cuda --preset deepseek-v3 --layers 8 \
        --emulate-ep 64 --link deepep-ib-ht --shape 256x128 --expert-schedule split merged

Takes ``python -m dbo.bench hf-prefill``'s options and, at the first ``--shape``, prints the
relative error and the top-1 agreement of the last position's logits for:

- plain against plain, and each DBO schedule against itself (two calls): a race between the
  streams shows here as a difference between two calls of the same thing (a GPU's atomics
  give a small one too, in plain as well);
- each DBO schedule against plain;
- plain over each half of the batch against the whole batch's rows: the rounding of the
  ubatches' smaller matmuls alone, with no overlap. Where DBO against plain is no further apart
  than this, its difference is rounding, not a fault.
"""

from __future__ import annotations

import sys

import torch

from dbo.bench.hf.model import alone, build_model
from dbo.bench.hf.prefill import parse_args, top1_agreement
from dbo.experts import relative_error
from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config, use_backend


def _line(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    rel, agree = relative_error(got, want), top1_agreement(got, want)
    print(f"  {what:<34} rel err {rel:.4f}   top-1 agree {agree:.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    m = opts.model
    if m.emulate_ep is None:
        print("split_noise: give --emulate-ep N (one process plays one rank)", file=sys.stderr)
        return 2
    device = alone(m.device)
    batch, seq = opts.shapes[0]
    g = torch.Generator().manual_seed(m.seed * 7919)
    ids = torch.randint(0, m.config.vocab_size, (batch, seq), generator=g).to(device)
    model = build_model(m.preset, m.config, m.dtype, device, seed=m.seed, convert=True, group=m.emulated)
    use_backend(model, opts.backends[0], **m.emulated_backend_kwargs("deepep_ht", batch * seq))
    print(f"{m.preset}, {m.config.num_hidden_layers} layers, {batch}x{seq}, {m.dtype}, emulated EP "
          f"{m.emulate_ep}", flush=True)
    with torch.inference_mode():
        plain = prefill_logits(model, ids, logits_to_keep=1)
        _line("plain vs plain", prefill_logits(model, ids, logits_to_keep=1), plain)
        half = batch // 2
        for lo, hi in ((0, half), (half, batch)):
            alone_rows = prefill_logits(model, ids[lo:hi], logits_to_keep=1)
            _line(f"plain rows {lo}:{hi} alone vs whole", alone_rows, plain[lo:hi])
        for sched in opts.expert_schedules:
            run = DBOPrefill(model, prefill_split_config(2, adaptive=False, expert_schedule=sched),
                             logits_to_keep=1, sm_carveout=opts.sm_carveout)
            first = run(ids)
            print(f"  ({sched}: {run.last_plan})")
            _line(f"dbo {sched} vs dbo {sched}", run(ids), first)
            _line(f"dbo {sched} vs plain", first, plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
