"""Prefill of a transformers MoE model made expert-parallel by dbo: plain vs DBO, per backend.

    torchrun --nproc-per-node 2 -m dbo.bench hf-prefill          # CPU, gloo, tiny Qwen3-MoE
    torchrun --nproc-per-node 2 -m dbo.bench hf-prefill --preset tiny-deepseek_v3 --backend naive all2all
    torchrun --nproc-per-node 2 -m dbo.bench hf-prefill --device cuda --preset qwen3-30b-a3b \\
        --backend deepep_ht all2all --shape 8x2048 16x4096 --unconverted --json qwen.json
    torchrun --nproc-per-node 2 -m dbo.bench hf-prefill --checkpoint DIR --backend all2all copy_engine
    # one GPU as rank 0 of EP 16 (plain python: the emulated backend, no process group)
    python -m dbo.bench hf-prefill --device cuda --preset qwen3-30b-a3b --emulate-ep 16 \
        --link deepep-ib-ht --shape 8x2048 16x4096

Without ``--checkpoint`` every rank builds the model from its config on the meta device,
converts it expert-parallel and materialises only its share, with seeded random weights
(:mod:`dbo.bench.hf.model`). ``--checkpoint DIR`` loads a saved checkpoint (``save_pretrained``'s,
or one from the Hub) expert-parallel with transformers' own loader and dbo's backends as its EP
implementations (transformers >= 5.23): each rank reads only its experts; ``--ep-experts library
model`` times both experts choices on the same loaded model. ``--save-checkpoint DIR`` writes the
``--preset``'s model with random weights there first (every rank its share) and loads it.

Each rank prefills its own batch (``--shape BATCHxSEQ``, tokens per rank) through
``prefill_logits`` (plain: the expert-parallel model without DBO) and through ``DBOPrefill`` (two
ubatches of sequences), for each ``--backend`` (switched with
:func:`dbo.integrations.transformers.use_backend`); times each (median of ``--steps`` after
``--warmup``, :func:`dbo.bench.timing.median_ms`; the slowest rank), checks that DBO gives the
plain run's logits (of the last ``--logits-to-keep`` positions;
:func:`dbo.bench.hf.prefill_table.logits_match` says how close counts as equal in bfloat16) and
prints a markdown table, then one verdict line (exit 1 where a row's logits differ). Under
``DBO_DISABLE=1`` the DBO rows run the plain forward: the table and the verdict say so.
``--unconverted`` also times the original model (all experts on every rank, no communication)
where it fits, and compares its logits with the expert-parallel model's.

``--emulate-ep N`` (plain ``python``, one process, no process group) plays rank
``--emulate-rank`` of an ``N``-rank group: the model holds that rank's ``E / N`` experts, and the
``emulated`` backend (:mod:`dbo.backends.emulated`) moves the rank's bytes in DeepEP's
high-throughput layout over ``--link``, its own tokens standing in for its peers'. The row is
``emulated deepep_ht``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dbo.backends import cpu_backends
from dbo.bench.cli import ArgumentParser, check_memory_fits, check_writable_folder, verdict
from dbo.bench.hf.args import add_model_arguments, backend_name, check_backends, check_model, model_options
from dbo.bench.hf.model import (
    alone,
    backend_kwargs,
    build_model,
    load_checkpoint,
    load_hf_all_to_all,
    peak_gib,
    reset_layers,
    reset_peak,
    save_checkpoint,
)
from dbo.bench.hf.options import EMULATED_BACKEND, EP_EXPERTS, EXPERT_SCHEDULES, PrefillOptions
from dbo.bench.hf.prefill_table import (
    PrefillResult,
    PrefillRow,
    logits_match,
    print_table,
    verdict_reason,
    write_json,
)
from dbo.bench.syncs import format_sites, host_syncs
from dbo.bench.timing import median_ms
from dbo.cli import run_main
from dbo.experts import relative_error
from dbo.files import whole_file
from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config, use_backend
from dbo.peers.collectives import all_reduce_max
from dbo.peers.process_group import distributed
from dbo.split import dbo_disabled_by_env

PROG = "hf-prefill"


def _shape(text: str) -> tuple[int, int]:
    try:
        b, s = (int(v) for v in text.lower().split("x"))
    except ValueError:
        b = s = 0
    if b < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want BATCHxSEQ with both >= 1, e.g. 8x2048")
    return b, s


def _carveout(text: str) -> int | None:
    try:
        value = None if text == "none" else int(text)
    except ValueError:
        value = -1
    if value is not None and value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want an integer >= 0 or 'none'")
    return value


def parse_args(argv: list[str] | None = None) -> PrefillOptions:
    """The options of command line ``argv`` (default ``sys.argv[1:]``); bad input ends the
    program in one line, exit code 2."""
    p = ArgumentParser(prog=f"python -m dbo.bench {PROG}", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--backend", nargs="+", type=backend_name, default=None,
                   help=f"dbo backends to time (default: {' '.join(cpu_backends())} on CPU, "
                        "deepep_ht all2all on CUDA)")
    p.add_argument("--shape", nargs="+", type=_shape, default=None,
                   help="BATCHxSEQ per rank (default: 4x32 on CPU; 8x2048 16x4096 on CUDA)")
    p.add_argument("--steps", type=int, default=5, help="timed calls (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--logits-to-keep", type=int, default=1,
                   help="positions whose logits are compared, 0: every position (default: 1)")
    p.add_argument("--unconverted", action="store_true",
                   help="also time the original model (all experts on every rank)")
    p.add_argument("--sm-carveout", type=int, default=None, help="DBO's sm_carveout")
    p.add_argument("--tune-sm-carveout", nargs="+", type=_carveout, default=None, metavar="N|none",
                   help="with --expert-schedule auto: the SM carve-outs the autotune tries (e.g. "
                        "none 16); it keeps the one that pays")
    p.add_argument("--expert-schedule", nargs="+", choices=EXPERT_SCHEDULES, default=["split"],
                   help="DBO's expert schedules to time, a row each (merged: one experts call per layer "
                        "over both ubatches' rows; auto: DBOPrefill.autotune at each shape picks split, "
                        "merged or plain; default: split)")
    p.add_argument("--max-tokens-per-rank", type=int, default=None,
                   help="for the backends sized by it (default: the largest shape's batch*seq)")
    p.add_argument("--profile", default=None,
                   help="DIR: on CUDA rank 0 writes torch.profiler GPU traces of one plain and one DBO "
                        "step of the last shape per backend (DIR/BACKEND/gpu_trace_{serial,dbo}.json, "
                        "for `python -m dbo.bench breakdown`)")
    p.add_argument("--find-syncs", action="store_true",
                   help="on CUDA, after the timings, run one plain and one DBO step per schedule under "
                        "torch's sync debug mode and print where each made the host wait for the GPU")
    p.add_argument("--hf-all-to-all", action="store_true",
                   help="with --checkpoint: first load it with transformers' own all_to_all EP "
                        "implementation and time its plain prefill; every other row's logits are "
                        "compared with it (column 'rel vs a2a')")
    p.add_argument("--ep-experts", nargs="+", default=None, choices=EP_EXPERTS,
                   help="with --checkpoint: the experts that run on what arrives, each timed (library: "
                        "dbo's on the model's weights; model: the model's own module; default: auto)")
    args = p.parse_args(argv)
    model = model_options(p, args)
    cuda = model.device == "cuda"
    try:
        opts = PrefillOptions(
            model=model, backends=args.backend or ([EMULATED_BACKEND] if model.emulate_ep is not None
                                                   else ["deepep_ht", "all2all"] if cuda else cpu_backends()),
            shapes=args.shape or ([(8, 2048), (16, 4096)] if cuda else [(4, 32)]), steps=args.steps,
            warmup=args.warmup, logits_to_keep=args.logits_to_keep, unconverted=args.unconverted,
            sm_carveout=args.sm_carveout, tune_sm_carveout=args.tune_sm_carveout,
            expert_schedules=args.expert_schedule, max_tokens_per_rank=args.max_tokens_per_rank,
            profile=args.profile, find_syncs=args.find_syncs, hf_all_to_all=args.hf_all_to_all,
            ep_experts=args.ep_experts)
    except ValueError as exc:
        p.error(str(exc))
    opts = dataclasses.replace(opts, model=check_model(p, model))
    if opts.profile:
        check_writable_folder(p, "--profile", opts.profile)
    check_backends(p, list(opts.backends), opts.model)
    batch, seq = max(opts.shapes, key=lambda shape: shape[0] * shape[1])
    hidden = getattr(opts.model.config, "hidden_size", None)
    if hidden:  # at least two hidden states of the largest shape (a layer's input and output)
        check_memory_fits(p, f"--shape {batch}x{seq} (hidden size {hidden})",
                          2 * batch * seq * hidden * opts.model.dtype.itemsize, opts.model.device)
    return opts


def top1_agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of sequences whose last position's top token agrees."""
    return (got[:, -1].argmax(-1) == want[:, -1].argmax(-1)).float().mean().item()


def _timed(fn: Callable[[], object], opts: PrefillOptions,
           device: torch.device) -> tuple[float, float | None]:
    """(median ms of ``fn`` on this rank, its peak GPU memory in GiB or None on the CPU)."""
    reset_peak(device)
    ms = median_ms(fn, steps=opts.steps, warmup=opts.warmup, device=device)
    return ms, peak_gib(device)


def _profile_step(fn: Callable[[], object], path: Path, rank: int, device: torch.device) -> None:
    """Run ``fn`` once on every rank (its collectives must match); on CUDA rank 0 records its GPU
    kernels with torch.profiler into ``path`` (Chrome JSON)."""
    if device.type != "cuda":
        return
    fn()
    torch.cuda.synchronize()
    if dist.is_initialized():  # (an emulated rank runs alone)
        dist.barrier()
    if rank != 0:
        fn()
        torch.cuda.synchronize()
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    with whole_file(path) as tmp:
        prof.export_chrome_trace(str(tmp))


def _anchor_rows(opts: PrefillOptions, inputs: dict, device: torch.device, rows: list[PrefillRow]) -> dict:
    """``--hf-all-to-all``: transformers' own expert-parallel model, a row per shape; returns its
    logits per shape (what every other row is compared with)."""
    ref = load_hf_all_to_all(opts.model.checkpoint, opts.model.dtype, device)
    anchor, keep = {}, opts.logits_to_keep
    with torch.no_grad():  # transformers' EP fails under inference_mode (its DTensor experts)
        for shape, ids in inputs.items():
            anchor[shape] = prefill_logits(ref, ids, logits_to_keep=keep).cpu()
            t, peak = _timed(lambda ids=ids, m=ref: prefill_logits(m, ids, logits_to_keep=keep), opts, device)
            t, peak = all_reduce_max([t, peak or 0.0], phase=PROG)
            rows.append(PrefillRow(backend="hf all_to_all", batch=shape[0], seq=shape[1], plain_ms=t,
                                   dbo_ms=None, rel_err=0.0, top1_agree=1.0, ok=None, split="",
                                   plain_peak_gib=peak if device.type == "cuda" else None, rel_vs_a2a=0.0))
    del ref
    gc.collect()
    return anchor


def _backend_rows(opts: PrefillOptions, model, backend: str, choice: str | None, inputs: dict, anchor: dict,
                  plain_logits: dict, device: torch.device, rank: int,
                  on_row: Callable[[PrefillRow], None]) -> None:
    """Time and check plain and DBO (per expert schedule) at every shape on ``backend``."""
    keep, cuda, multi = opts.logits_to_keep, device.type == "cuda", len(opts.expert_schedules) > 1
    max_tokens = opts.max_tokens_per_rank or opts.largest_batch_tokens
    if opts.model.emulate_ep is not None:  # the prefill in DeepEP's high-throughput layout
        use_backend(model, backend, **opts.model.emulated_backend_kwargs("deepep_ht", max_tokens))
    else:
        use_backend(model, backend, **backend_kwargs(backend, max_tokens_per_rank=max_tokens,
                                                     link=opts.model.link_model))
    # adaptive=False: each row times the schedule it names ("auto" is the autotune's choice)
    runners = {sched: DBOPrefill(model, prefill_split_config(
        2, adaptive=False, **({} if sched == "auto" else {"expert_schedule": sched})),
        logits_to_keep=keep, sm_carveout=opts.sm_carveout) for sched in opts.expert_schedules}
    for shape, ids in inputs.items():
        plain = prefill_logits(model, ids, logits_to_keep=keep)
        plain_logits.setdefault(shape, plain.cpu())
        vs_a2a = relative_error(plain, anchor[shape].to(device)) if shape in anchor else -1.0
        t_plain, peak_plain = _timed(lambda ids=ids: prefill_logits(model, ids, logits_to_keep=keep),
                                     opts, device)
        for sched, run_dbo in runners.items():
            tuned = None
            if sched == "auto":  # the plain, split and merged prefill timed at this shape
                tuned = run_dbo.autotune(ids.shape[1], [ids.shape[0]], vocab_size=model.config.vocab_size,
                                         warmup=opts.warmup, steps=opts.steps,
                                         sm_carveouts=opts.tune_sm_carveout)
            got = run_dbo(ids)
            rel, agree = relative_error(got, plain), top1_agreement(got, plain)
            t_dbo, peak_dbo = _timed(lambda ids=ids, r=run_dbo: r(ids), opts, device)
            t_p, t_d, rel, neg_agree, p_plain, p_dbo, vs = all_reduce_max(
                [t_plain, t_dbo, rel, -agree, peak_plain or 0.0, peak_dbo or 0.0, vs_a2a], phase=PROG)
            name = "emulated deepep_ht" if opts.model.emulate_ep is not None else backend
            label = name if not multi else f"{name}/{sched}"
            if tuned is not None:
                picked = tuned.schedule.value
                label += f" ({picked})" if multi else f"/auto ({picked})"
            if choice is not None and len(opts.experts_choices) > 1:
                label = f"{label} ({choice} experts)"
            on_row(PrefillRow(backend=label, batch=shape[0], seq=shape[1], plain_ms=t_p, dbo_ms=t_d,
                              rel_err=rel, top1_agree=-neg_agree,
                              ok=logits_match(rel, -neg_agree, opts.model.dtype),
                              split=str(run_dbo.last_plan), expert_schedule=sched,
                              autotune=None if tuned is None else {
                                  "choice": tuned.schedule.value, "plain_ms": tuned.rows[0].serial_ms,
                                  "split_ms": tuned.rows[0].dbo_ms, "merged_ms": tuned.rows[0].merged_ms,
                                  "sm_carveout": tuned.sm_carveout},
                              plain_peak_gib=p_plain if cuda else None, dbo_peak_gib=p_dbo if cuda else None,
                              rel_vs_a2a=None if vs < 0 else vs))
    ids = inputs[opts.shapes[-1]]
    steps = {"plain": lambda: prefill_logits(model, ids, logits_to_keep=keep)}
    steps.update({f"dbo/{s}": (lambda r=r: r(ids)) for s, r in runners.items()})
    if opts.find_syncs and cuda:  # every rank steps (collectives); rank 0 prints
        for name, step in steps.items():
            with host_syncs() as sites:
                step()
            if rank == 0:
                print(f"host syncs, {backend} {name}, shape {ids.shape[0]}x{ids.shape[1]}: "
                      f"{sum(site.count for site in sites)}\n" + format_sites(sites), flush=True)
    if opts.profile:
        where = Path(opts.profile) / backend
        _profile_step(steps["plain"], where / "gpu_trace_serial.json", rank, device)
        _profile_step(steps[f"dbo/{opts.expert_schedules[0]}"], where / "gpu_trace_dbo.json", rank, device)
    reset_layers(model)


def _unconverted_rows(opts: PrefillOptions, inputs: dict, plain_logits: dict, device: torch.device,
                      on_row: Callable[[PrefillRow], None]) -> None:
    """``--unconverted``: the whole model on every rank, where every rank can hold it."""
    m = opts.model
    try:
        full = load_checkpoint(m.checkpoint, m.dtype, device, backend=None) if m.checkpoint \
            else build_model(m.preset, m.config, m.dtype, device, seed=m.seed, convert=False)
        built = 1.0
    except torch.OutOfMemoryError:
        full, built = None, 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if all_reduce_max([-built], phase=PROG)[0] < 0:  # every rank built it (else all skip it together)
        keep = opts.logits_to_keep
        for shape, ids in inputs.items():
            out = prefill_logits(full, ids, logits_to_keep=keep)
            want = plain_logits[shape].to(device)
            rel, agree = relative_error(want, out), top1_agreement(want, out)
            t = median_ms(lambda ids=ids: prefill_logits(full, ids, logits_to_keep=keep), steps=opts.steps,
                          warmup=opts.warmup, device=device)
            t, rel, neg_agree = all_reduce_max([t, rel, -agree], phase=PROG)
            on_row(PrefillRow(backend="unconverted", batch=shape[0], seq=shape[1], plain_ms=t, dbo_ms=None,
                              rel_err=rel, top1_agree=-neg_agree,
                              ok=logits_match(rel, -neg_agree, m.dtype), split=""))
    else:
        on_row(PrefillRow(backend="unconverted", batch=0, seq=0, plain_ms=None, dbo_ms=None, rel_err=None,
                          top1_agree=None, ok=None, split="out of memory"))


def run(opts: PrefillOptions, rank: int, world: int, device: torch.device) -> int:
    """Build or load the model, time every row, print the table (rank 0); returns the exit code."""
    m = opts.model
    config = m.config
    if m.save_checkpoint:
        save_checkpoint(config, m.save_checkpoint, m.dtype, device, m.seed, rank)
    g = torch.Generator().manual_seed(m.seed * 7919 + rank)
    inputs = {shape: torch.randint(0, config.vocab_size, shape, generator=g).to(device)
              for shape in opts.shapes}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    # DBO_DISABLE: every plan unsplit, the DBO rows run the plain forward
    result = PrefillResult(preset=m.preset, checkpoint=m.checkpoint, layers=config.num_hidden_layers,
                           world=world, device=name, dtype=str(m.dtype), steps=opts.steps,
                           dbo_disabled=dbo_disabled_by_env(), emulated=m.emulation_record())

    def on_row(row: PrefillRow) -> None:
        result.rows.append(row)
        if rank == 0:
            write_json(result, m.json)  # a later timeout keeps these

    anchor = _anchor_rows(opts, inputs, device, result.rows) if opts.hf_all_to_all else {}
    t0 = time.perf_counter()
    if m.checkpoint:
        model = load_checkpoint(m.checkpoint, m.dtype, device, backend=opts.backends[0])
        config = model.config
    else:
        model = build_model(m.preset, config, m.dtype, device, seed=m.seed, convert=True, group=m.emulated)
    build_s = time.perf_counter() - t0
    plain_logits: dict = {}
    with torch.inference_mode():
        for choice in opts.experts_choices:
            if choice is not None:
                from dbo.integrations.transformers.ep_model import switch_ep_experts

                switch_ep_experts(model, choice)
            for backend in opts.backends:
                _backend_rows(opts, model, backend, choice, inputs, anchor, plain_logits, device, rank,
                              on_row)
        if opts.unconverted:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _unconverted_rows(opts, inputs, plain_logits, device, on_row)
    if rank != 0:
        return 0 if all(r.ok is not False for r in result.rows) else 1
    result.layers = config.num_hidden_layers
    print_table(result, cuda=device.type == "cuda", hidden=config.hidden_size, build_s=build_s,
                link="" if m.link_model is None else m.link_model.describe())
    write_json(result, m.json)
    return verdict(PROG, *verdict_reason(result.rows, m.json, result.dbo_disabled))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.model.emulate_ep is not None:  # one process plays the rank: no process group
        return run(opts, 0, 1, alone(opts.model.device))
    with distributed(opts.model.device) as (rank, world, device):
        return run(opts, rank, world, device)


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
