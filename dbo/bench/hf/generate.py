"""Greedy decoding of a transformers MoE model loaded expert-parallel: transformers' ``generate()``
with its own ``all_to_all`` expert parallelism beside dbo's ``greedy_generate`` on dbo's backends.

    torchrun --nproc-per-node 2 -m dbo.bench hf-generate         # CPU, gloo: a tiny Qwen3-MoE
    torchrun --nproc-per-node 4 -m dbo.bench hf-generate --device cuda --preset qwen3-30b-a3b \\
        --save-checkpoint /tmp/q48 --batch 64 --prompt 512 --new-tokens 64 \\
        --backend copy_engine deepep_ht/deepep_ll
    # one GPU as rank 0 of EP 16 (plain python: the emulated backend, no process group)
    python -m dbo.bench hf-generate --device cuda --preset qwen3-30b-a3b --emulate-ep 16 \
        --link deepep-ib --batch 64 --prompt 512 --new-tokens 64 \
        --modes plain graph dbo-prefill-graph dbo-graph

Both loads read a checkpoint: ``--checkpoint DIR``, or ``--preset`` written with random weights to
``--save-checkpoint DIR`` or, without either (CPU only), to a temporary directory removed at the
end. Every rank decodes its own batch of ``--batch`` random prompts of ``--prompt`` tokens for
``--new-tokens`` steps (greedy), first with transformers' ``generate()`` on the checkpoint loaded
with its own ``all_to_all`` implementation (under ``no_grad``, which it needs), then, on the
checkpoint loaded with dbo's implementations, with
:func:`dbo.integrations.transformers.generate.greedy_generate` per ``--backend``: plain (no
split), "DBO prefill" (the prompt as two overlapped ubatches of sequences, then their caches
joined and the decode steps plain: ``greedy_generate``'s default) and "DBO" (every step
overlapped, each ubatch with its own KV cache: ``split_decode=True``). A backend
``PREFILL/DECODE`` (``deepep_ht/deepep_ll``) moves the prompts through the first and the decode
steps through the second (:func:`dbo.integrations.transformers.use_backend`'s
``decode_backend``). It prints tokens/s per GPU (per rank on CPU: new tokens of the batch over the
whole call, prefill included; slowest rank; median of ``--steps`` calls after ``--warmup``), the
prefill's time (the same call with one new token) and how far each run's tokens agree with
``generate()``'s: bf16 rounding differs between implementations, and a near-tie flips a token,
after which the sequences part ways. So the agreement is the share of sequences identical to the
end, and the mean share of new tokens before the first difference; each DBO row gives the same
against its plain row too. The verdict: every DBO run's tokens equal its plain run's (float32),
or its first new token agrees for at least 75% of the sequences (bfloat16).

Beside eager ``generate()`` the table has transformers' own fast path on the same
``all_to_all`` model, ``generate(..., cache_implementation="static")`` (a static KV cache, and
on CUDA the forward compiled with ``torch.compile`` by transformers itself: its documented way
to decode fast); where transformers refuses or fails in that mode with expert parallelism, the
row says how (``--no-static`` leaves it out). dbo's speed-ups are quoted against the faster of
the two.

The three dbo rows of a backend are measured together so that they compare like with like: after
``--warmup`` untimed calls of each, every round times one call of each, in an order that rotates
from round to round (plain first, then DBO prefill first, ...) and runs backwards every other
round, for ``--steps`` rounds; each row gives its median and its spread (fastest and slowest
call), and the same for the prefill calls. A fixed order (plain, then DBO prefill, then DBO, each
over all its calls) charges whatever drifts over the minutes of a run (the allocator's cache
growing, the GPU's clocks) to the rows in turn.

``--emulate-ep N`` (plain ``python``, one process, no process group) plays rank
``--emulate-rank`` of an ``N``-rank group: the model is ``--preset`` built with random weights
holding that rank's ``E / N`` experts (no checkpoint), and the ``emulated`` backend
(:mod:`dbo.backends.emulated`) moves the rank's bytes over ``--link`` in DeepEP's
high-throughput layout for the prompt and its low-latency one inside the decode steps, as the
``deepep_ht/deepep_ll`` pair does; its own tokens stand in for its peers'. There is no
``generate()`` row (transformers' expert parallelism needs a process group): agreement is
against the plain row, and the table ends with the fastest overlapped row against the plain
and plain graph rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from dbo.bench.cli import ArgumentParser, verdict
from dbo.bench.hf.args import add_model_arguments, backend_name, check_backends, check_model, model_options
from dbo.bench.hf.generate_table import (
    COMPUTE_ALONE,
    PLAIN_MODES,
    GenerateResult,
    GenerateRow,
    model_name,
    print_table,
    verdict_reason,
)
from dbo.bench.hf.model import (
    alone,
    backend_kwargs,
    build_model,
    load_checkpoint,
    load_hf_all_to_all,
    save_checkpoint,
    shared_temporary_dir,
)
from dbo.bench.hf.options import EMULATED_BACKEND, GENERATE_MODES, GenerateOptions
from dbo.bench.timing import median_ms
from dbo.cli import run_main
from dbo.files import write_whole
from dbo.integrations.transformers import use_backend
from dbo.peers.collectives import all_reduce_max
from dbo.peers.process_group import distributed
from dbo.split import DISABLE_ENV_VAR, SplitConfig, dbo_disabled_by_env

PROG = "hf-generate"
#: option -> (row name, prefill overlapped, every decode step overlapped, decode from a CUDA graph)
MODES = GENERATE_MODES
DEFAULT_MODES = ("plain", "dbo-prefill", "dbo")


def _backend_pair(text: str) -> tuple[str, str | None]:
    prefill, slash, decode = text.partition("/")
    if slash and not decode:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME or PREFILL/DECODE")
    return backend_name(prefill), backend_name(decode) if decode else None


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def parse_args(argv: list[str] | None = None) -> GenerateOptions:
    """The options of command line ``argv`` (default ``sys.argv[1:]``); bad input ends the
    program in one line, exit code 2."""
    p = ArgumentParser(prog=f"python -m dbo.bench {PROG}", description=__doc__.split("\n\n")[0])
    add_model_arguments(p, without_checkpoint="on CPU, --preset written with random weights to a "
                                              "temporary directory, removed at the end; on CUDA, give "
                                              "--checkpoint or --save-checkpoint")
    p.add_argument("--backend", nargs="+", type=_backend_pair, default=None, metavar="NAME|PREFILL/DECODE",
                   help="(default: all2all copy_engine on CPU, copy_engine deepep_ht/deepep_ll on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (CPU 4, CUDA 64)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (CPU 8, CUDA 512)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (CPU 4, CUDA 64)")
    p.add_argument("--steps", type=int, default=3, help="timed calls (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (default: 1)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(DEFAULT_MODES),
                   help="the dbo rows of each backend: plain, DBO prefill (the prompt overlapped, the "
                        "decode steps plain: greedy_generate's default), DBO (every step overlapped), "
                        "graph and dbo-prefill-graph (plain or DBO prefill, then the decode steps from a "
                        "static cache replayed from a CUDA graph: cuda_graph=True), dbo-graph (every step "
                        "overlapped, the decode steps from a static cache per ubatch replayed from a CUDA "
                        "graph) (default: plain dbo-prefill dbo)")
    p.add_argument("--sm-carveout", type=int, default=None, metavar="N",
                   help="the SMs the matmuls of the overlapped steps leave free (greedy_generate's "
                        "sm_carveout): room for the communication beside the experts (default: none)")
    p.add_argument("--no-static", dest="static", action="store_false",
                   help="leave out transformers' generate() with cache_implementation='static' (its "
                        "static cache, compiled on CUDA)")
    a = p.parse_args(argv)
    model = model_options(p, a)
    cuda = model.device == "cuda"
    try:
        # without either checkpoint option, a checkpoint of --preset for this run only (made once
        # the group exists)
        opts = GenerateOptions(
            model=model, pairs=a.backend or (
                [(EMULATED_BACKEND, EMULATED_BACKEND)] if model.emulate_ep is not None
                else [("copy_engine", None), ("deepep_ht", "deepep_ll")] if cuda
                else [("all2all", None), ("copy_engine", None)]),
            batch=_given(a.batch, 64 if cuda else 4), prompt=_given(a.prompt, 512 if cuda else 8),
            new_tokens=_given(a.new_tokens, 64 if cuda else 4), steps=a.steps, warmup=a.warmup,
            modes=a.modes, static=a.static, sm_carveout=a.sm_carveout,
            temporary_checkpoint=not model.checkpoint and model.emulate_ep is None)
    except ValueError as exc:
        p.error(str(exc))
    opts = opts.with_model(check_model(p, model, always_loads=True))
    check_backends(p, [name for pair in opts.pairs for name in pair if name], opts.model)
    return opts


def _agreement(got: torch.Tensor, want: torch.Tensor, prompt: int) -> tuple[float, float, float]:
    """(share of sequences identical to the end, mean share of new tokens before the first
    difference, share whose first new token agrees)."""
    g, w = got[:, prompt:], want[:, prompt:]
    same = g == w
    first = torch.where(same.all(1), torch.full_like(same[:, 0], g.shape[1], dtype=torch.long),
                        (~same).long().argmax(1))
    return (same.all(1).float().mean().item(), (first.float() / g.shape[1]).mean().item(),
            same[:, 0].float().mean().item())




#: a new token counts as the teacher-forced forward's choice where its logit is within this share
#: of the position's logit standard deviation of the largest (bf16 rounding between kernels)
TF_TOLERANCE = 0.05


def teacher_forced_share(model: torch.nn.Module, seqs: torch.Tensor, prompt: int,
                         tol: float = TF_TOLERANCE, max_tokens: int | None = None,
                         attention_mask: torch.Tensor | None = None) -> float:
    """The share of the new tokens of ``seqs`` (``[batch, prompt + new]``, from a greedy decode)
    that one plain forward over the whole sequences, without a cache, also picks: the token's
    logit within ``tol`` logit standard deviations of the position's largest. It checks the
    decode steps themselves (cache, positions, mask), which the first new token (the prefill's)
    does not; near ties, which bf16 rounding resolves either way, still count. Collective (a
    forward of the MoE layers): every rank calls it with the same shapes. ``max_tokens``: the
    most tokens per forward (a backend's buffers are sized for the prompt's), in chunks of whole
    sequences. ``attention_mask``: the prompts' ``[batch, prompt]`` (left padding; positions
    then follow it, as in the decode); None: no padding."""
    from dbo.integrations.transformers.generate import mask_positions
    from dbo.integrations.transformers.moe_block import routing_token_mask

    new = seqs.shape[1] - prompt
    rows = seqs.shape[0] if max_tokens is None else max(1, max_tokens // (seqs.shape[1] - 1))
    full = torch.ones_like(seqs) if attention_mask is None else torch.cat(
        [attention_mask.to(seqs.dtype), torch.ones_like(seqs[:, prompt:])], dim=1)
    ok = 0
    for r0 in range(0, seqs.shape[0], rows):
        chunk, mask = seqs[r0:r0 + rows, :-1], full[r0:r0 + rows, :-1]  # p predicts p + 1
        with routing_token_mask(mask):
            logits = model(input_ids=chunk, attention_mask=mask, use_cache=False, logits_to_keep=new,
                           position_ids=mask_positions(mask)).logits
        target = seqs[r0:r0 + rows, prompt:]
        for lo in range(0, logits.shape[0], 8):  # float32 in slices of 8 sequences
            part = logits[lo:lo + 8].float()
            gap = part.amax(-1) - part.gather(-1, target[lo:lo + 8, :, None])[..., 0]
            ok += int((gap <= tol * part.std(-1)).sum())
    return ok / (seqs.shape[0] * new)


def interleaved_ms(calls: dict[str, Callable[[], object]], rounds: int, warmup: int,
                   device: torch.device) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Time each of ``calls`` once a round for ``rounds`` rounds, after ``warmup`` untimed calls
    of each: the order rotates by one every round and runs backwards every other round, so no
    call always goes first or after the same one. Returns each call's ms per round (this rank)
    and its last result."""
    names = list(calls)
    last: dict[str, object] = {}
    for _ in range(warmup):
        for n in names:
            last[n] = calls[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in (order if r % 2 == 0 else order[::-1]):
            def call(n: str = n) -> None:
                last[n] = calls[n]()

            times[n].append(median_ms(call, steps=1, warmup=0, device=device))
    return times, last


def _timed(fn: Callable[[], object], steps: int, warmup: int, device: torch.device) -> tuple[float, object]:
    """(median ms of ``fn`` on this rank, its last result)."""
    last: list[object] = [None]

    def call() -> None:
        last[0] = fn()

    return median_ms(call, steps=steps, warmup=warmup, device=device), last[0]


def _add_row(rows: list[GenerateRow], rank: int, row: GenerateRow) -> None:
    """Keep ``row`` and print it at once (rank 0): a run cut short still shows what it measured."""
    rows.append(row)
    if rank == 0:
        vs_plain = (f"; against plain: identical {row.same_plain:.2f}, before 1st diff "
                    f"{row.prefix_plain:.2f}; teacher-forced {row.teacher_forced:.3f}"
                    if row.same_plain is not None else "")
        spread = f" [{row.ms_min:.1f}-{row.ms_max:.1f}]" if row.ms_min is not None else ""
        prefill = "" if row.prefill_ms is None else f" (prefill {row.prefill_ms:.1f})"
        print(f"row: {row.run}: {row.ms:.1f} ms{spread}{prefill}, "
              f"{row.tok_s:,.0f} new tokens/s, identical {row.same:.2f}, "
              f"before 1st diff {row.prefix:.2f}{vs_plain}",
              flush=True)


#: transformers' generate() rows: (run name, generate()'s extra keyword arguments)
HF_RUNS = {"eager": ("transformers generate (all_to_all)", {}),
           "static": ("transformers generate, static cache (all_to_all)", {"cache_implementation": "static"})}


def transformers_generate(a: GenerateOptions, ids: torch.Tensor, mask: torch.Tensor,
                         device: torch.device) -> dict[str, tuple[float, float, torch.Tensor] | str]:
    """transformers' ``generate()`` on the checkpoint loaded with its own ``all_to_all``, eager and
    (``--static``) with its static cache: per :data:`HF_RUNS` key, (median ms of the whole call,
    of a one-token call, the last call's ids), or the one line of the error it raised (every rank
    runs the same calls, so a refusal is every rank's). The model is freed on return, before
    dbo's is loaded."""
    ref = load_hf_all_to_all(a.model.checkpoint, a.model.dtype, device)
    out: dict[str, tuple[float, float, torch.Tensor] | str] = {}
    with torch.no_grad():  # transformers' own EP fails under inference_mode
        for key in ("eager", "static") if a.static else ("eager",):
            extra = HF_RUNS[key][1]

            def hf_generate(tokens: int, extra: dict = extra) -> torch.Tensor:
                return ref.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=tokens, min_new_tokens=tokens, **extra)

            try:
                ms, want = _timed(lambda: hf_generate(a.new_tokens), a.steps, a.warmup, device)
                pre_ms = median_ms(lambda: hf_generate(1), steps=a.steps, warmup=1, device=device)
            except Exception as exc:  # noqa: BLE001 - the row reports transformers' refusal
                if key == "eager":
                    raise
                out[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                continue
            out[key] = (ms, pre_ms, want)
    return out


def run(a: GenerateOptions, rank: int, world: int, device: torch.device) -> list[GenerateRow]:
    m = a.model
    if m.save_checkpoint:
        save_checkpoint(m.config, m.save_checkpoint, m.dtype, device, m.seed, rank)
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, m.config.vocab_size, (a.batch, a.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    new = a.batch * a.new_tokens
    rows: list[GenerateRow] = []

    if m.emulate_ep is not None:  # no generate() row: transformers' EP needs a process group
        model = build_model(m.preset, m.config, m.dtype, device, seed=m.seed, convert=True, group=m.emulated)
        return _dbo_rows(a, model, ids, mask, None, rank, rows)
    hf = transformers_generate(a, ids, mask, device)
    ms, pre_ms, want = hf["eager"]
    ms, pre_ms = all_reduce_max([ms, pre_ms], phase=PROG)
    _add_row(rows, rank, GenerateRow(run=HF_RUNS["eager"][0], mode="hf-eager", ms=ms, prefill_ms=pre_ms,
                                     tok_s=new / ms * 1e3, same=1.0, prefix=1.0))
    if "static" in hf:
        res = hf["static"]
        failed = all_reduce_max([float(isinstance(res, str))], phase=PROG)[0]
        if failed:  # on any rank: the row says how (this rank's words, or a peer's failure)
            error = res if isinstance(res, str) else "failed on another rank"
            rows.append(GenerateRow(run=HF_RUNS["static"][0], mode="hf-static", error=error))
            if rank == 0:
                print(f"row: {HF_RUNS['static'][0]}: failed: {error}", flush=True)
        else:
            s_ms, s_pre, s_ids = res
            same, prefix, _ = _agreement(s_ids, want, a.prompt)
            s_ms, s_pre, neg_same, neg_prefix = all_reduce_max([s_ms, s_pre, -same, -prefix], phase=PROG)
            _add_row(rows, rank, GenerateRow(run=HF_RUNS["static"][0], mode="hf-static", ms=s_ms,
                                             prefill_ms=s_pre, tok_s=new / s_ms * 1e3, same=-neg_same,
                                             prefix=-neg_prefix))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = load_checkpoint(m.checkpoint, m.dtype, device, backend=a.pairs[0][0])
    return _dbo_rows(a, model, ids, mask, want, rank, rows)


def _dbo_rows(a: GenerateOptions, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
              want: torch.Tensor | None, rank: int, rows: list[GenerateRow]) -> list[GenerateRow]:
    """The rows of dbo's ``greedy_generate`` per backend pair and mode; agreement against
    ``want`` (``generate()``'s tokens; None: the plain row's)."""
    from dbo.integrations.transformers.generate import greedy_generate

    m, device, new = a.model, ids.device, a.batch * a.new_tokens
    plain_cfg = SplitConfig(enabled=False)
    dbo_cfg = SplitConfig(prefill_token_threshold=2, decode_token_threshold=2)
    with torch.inference_mode():
        for prefill, decode in a.pairs:
            if m.emulate_ep is not None:  # the prompt in DeepEP's high-throughput layout, decode low-latency
                _use_emulated(a, model, prefill, decode)
                label = "emulated deepep_ht/deepep_ll"
            else:
                decode_kw = None if decode is None else backend_kwargs(decode, max_tokens_per_rank=a.batch,
                                                                        link=m.link_model)
                use_backend(model, prefill, decode_backend=decode, decode_backend_kwargs=decode_kw,
                            **backend_kwargs(prefill, max_tokens_per_rank=a.batch * a.prompt,
                                             link=m.link_model))
                label = prefill if decode is None else f"{prefill}/{decode}"
            modes = tuple((name, dbo_cfg if split else plain_cfg, every, graph)
                          for k, (name, split, every, graph) in MODES.items() if k in a.modes)
            times, last = interleaved_ms({name: _decode_call(a, model, ids, mask, split, every, graph)
                                          for name, split, every, graph in modes}, a.steps, a.warmup, device)
            pre_times, _ = interleaved_ms({name: (lambda split=split: greedy_generate(
                model, ids, mask, max_new_tokens=1, config=split, sm_carveout=a.sm_carveout))
                for name, split, *_ in modes},
                a.steps, 1, device)
            plain = last["plain"][0]
            for name, cfg, *_ in modes:
                got, plan = last[name]
                same, prefix, _ = _agreement(got, plain if want is None else want, a.prompt)
                vs_plain = _agreement(got, plain, a.prompt)
                tf = teacher_forced_share(model, got, a.prompt, max_tokens=a.batch * a.prompt)
                t, pt = times[name], pre_times[name]
                # the slowest rank's median, fastest and slowest call; the lowest agreements
                ms, lo, hi, pre_ms, *neg = all_reduce_max(
                    [statistics.median(t), min(t), max(t), statistics.median(pt), -same, -prefix,
                     *(-v for v in vs_plain), -tf], phase=PROG)
                # DBO_DISABLE makes every plan unsplit: the DBO rows then time the plain forward
                off = f" (ran plain: {DISABLE_ENV_VAR}=1)" if cfg is dbo_cfg and dbo_disabled_by_env() else ""
                _add_row(rows, rank, GenerateRow(
                    run=f"dbo greedy_generate {label} {name}{off}", mode=name, ms=ms, ms_min=lo, ms_max=hi,
                    rounds=len(t), prefill_ms=pre_ms, tok_s=new / ms * 1e3, same=-neg[0], prefix=-neg[1],
                    same_plain=-neg[2], prefix_plain=-neg[3], first_plain=-neg[4], teacher_forced=-neg[5],
                    split=str(plan)))
            if m.emulate_ep is not None and m.link_model is not None:
                _use_emulated(a, model, prefill, decode, link=False)
                _compute_alone_row(a, model, ids, mask, modes, label, plain, rows)
                _use_emulated(a, model, prefill, decode)
    return rows


def _decode_call(a: GenerateOptions, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 config: SplitConfig, every: bool, graph: bool) -> Callable[[], Any]:
    """One row's call: ``greedy_generate`` of ``a.new_tokens`` under ``config``, splitting every
    decode step (``every``) or the prompt only, the decode steps from a CUDA graph (``graph``)."""
    from dbo.integrations.transformers.generate import greedy_generate

    return lambda: greedy_generate(model, ids, mask, max_new_tokens=a.new_tokens, config=config,
                                   split_decode=every, cuda_graph=graph, sm_carveout=a.sm_carveout)


def _use_emulated(a: GenerateOptions, model: torch.nn.Module, prefill: str, decode: str | None, *,
                  link: bool = True) -> None:
    """An emulated rank's backends: the prompt in DeepEP's high-throughput layout, the decode
    steps in its low-latency one; ``link=False``: the rank's own work with no link waits."""
    m = a.model
    use_backend(model, prefill, decode_backend=decode,
                decode_backend_kwargs=m.emulated_backend_kwargs("deepep_ll", a.batch, link=link),
                **m.emulated_backend_kwargs("deepep_ht", a.batch * a.prompt, link=link))


def _compute_alone_row(a: GenerateOptions, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                       modes: tuple, label: str, plain: torch.Tensor, rows: list[GenerateRow]) -> None:
    """An emulated rank whose backends now run with the link off: the fastest plain mode that
    ran (graph decode where it did) again, the compute alone (the emulated rank's own work
    included), for the bound that ``print_table`` puts beside the overlapped rows."""
    ms = {r.mode: r.ms for r in rows if r.ms is not None}
    plain_modes = [mode for mode in modes if mode[0] in ms and mode[0] in PLAIN_MODES]
    if not plain_modes:
        return
    name, cfg, every, graph = min(plain_modes, key=lambda mode: ms[mode[0]])
    times, last = interleaved_ms({COMPUTE_ALONE: _decode_call(a, model, ids, mask, cfg, every, graph)},
                                 a.steps, a.warmup, ids.device)
    got, plan = last[COMPUTE_ALONE]
    same, prefix, _ = _agreement(got, plain, a.prompt)
    t = times[COMPUTE_ALONE]
    _add_row(rows, 0, GenerateRow(
        run=f"dbo greedy_generate {label} {name}, link off", mode=COMPUTE_ALONE,
        ms=statistics.median(t), ms_min=min(t), ms_max=max(t), rounds=len(t),
        tok_s=a.batch * a.new_tokens / statistics.median(t) * 1e3, same=same, prefix=prefix,
        split=f"{plan} (the compute alone of {name!r})"))


def _write_json(a: GenerateOptions, rows: list[GenerateRow], world: int, disabled: bool) -> None:
    if a.model.json:
        result = GenerateResult(model=model_name(a), world=world, batch=a.batch, prompt=a.prompt,
                                new_tokens=a.new_tokens, dbo_disabled=disabled, rows=rows,
                                emulated=a.model.emulation_record(), sm_carveout=a.sm_carveout)
        write_whole(a.model.json, json.dumps(result.to_json(), indent=1))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.model.emulate_ep is not None:  # one process plays the rank: no process group
        device = alone(a.model.device)
        rows = run(a, 0, 1, device)
        disabled = dbo_disabled_by_env()
        ok, why = verdict_reason(a, rows, disabled)
        print_table(a, rows, 1, device, disabled)
        _write_json(a, rows, 1, disabled)
        verdict(PROG, ok, why)
        return 0 if ok else 1
    made: str | None = None  # the temporary checkpoint, on the rank that made it
    try:
        with distributed(a.model.device) as (rank, world, device):
            if a.temporary_checkpoint:
                a = a.with_model(a.model.written_to(shared_temporary_dir("dbo-hf-generate-"), write=True))
                made = a.model.checkpoint if rank == 0 else None
            rows = run(a, rank, world, device)
            disabled = dbo_disabled_by_env()
            ok, why = verdict_reason(a, rows, disabled)
            if rank == 0:
                print_table(a, rows, world, device, disabled)
                _write_json(a, rows, world, disabled)
                verdict(PROG, ok, why)
    finally:
        if made is not None:  # after the group's teardown: every rank is done with its files
            shutil.rmtree(made, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
