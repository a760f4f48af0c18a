"""Loading a real-sized checkpoint expert-parallel on CPU: peak RSS and load time per rank.

    python -m dbo.bench hf-load --dir /tmp/qwen3-30b-a3b-2l            # writes it if absent
    python -m dbo.bench hf-load --dir DIR --ranks 2 --backend all2all --check --json load.json

The checkpoint is ``--preset``'s shape (default Qwen3-30B-A3B's: hidden 2048, 128 experts of
intermediate 768, top-8, vocabulary 151936) cut to ``--layers`` decoder layers (2: about 3.6 GB in
bf16; ``--preset tiny-qwen3_moe`` for a smoke run), random weights, written once by one process
(:func:`~dbo.integrations.transformers.checkpoint.write_random_checkpoint`). Then, each in fresh
processes under ``torchrun --nproc-per-node RANKS`` (peak RSS is a per-process high-water mark):

* ``plain``: every rank ``from_pretrained(DIR, dtype=bf16)``: the whole model on every rank;
* ``ep``: every rank ``from_pretrained(DIR, dtype=bf16, distributed_config=
  ep_distributed_config(BACKEND))``: transformers reads this rank's experts only, dbo's backend
  moves the tokens; then a first prefill under ``torch.inference_mode()`` as loaded (it gathers
  the dense weights once and keeps them whole: ``dbo.integrations.transformers.fsdp``) and one
  overlapped prefill (``DBOPrefill``) of a small batch, checked against the plain model's logits
  when ``--check`` (loads the plain model too, after the measurement).

Each rank reports: RSS after imports, peak RSS (``ru_maxrss``) after loading and after the first
prefill, the load's wall time, and the bytes of routed experts it holds; in ``ep`` mode also the
bytes FSDP2 all-gathers in the first prefill (the dense weights, once) and in the overlapped
prefill after it (none). Safetensors are memory-mapped: pages of the file a process touched count
in its RSS (and are shared with the page cache), so RSS is what the process touched, not only what
it allocated. The verdict: every ``ep`` rank holds 1/RANKS of the routed experts, its overlapped
prefill gathered nothing, and (``--check``) its logits match the plain model's. Each rank's
numbers are a :class:`~dbo.bench.hf.load_table.LoadRow`, the run a
:class:`~dbo.bench.hf.load_table.LoadResult` (the ``--json`` file) that the table and the verdict
read (:mod:`dbo.bench.hf.load_table`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from dbo.backends import cpu_backends
from dbo.bench.cli import ArgumentParser, check_writable_file, check_writable_folder, verdict
from dbo.bench.hf.args import PRESET_CHOICES, backend_name, model_config, num_routed_experts
from dbo.bench.hf.load_table import LoadResult, LoadRow, print_table, verdict_reason, write_json
from dbo.bench.hf.options import LoadOptions
from dbo.cli import run_main
from dbo.files import write_whole

PROG = "hf-load"


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak resident set so far (MiB; ``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: LoadOptions) -> None:
    """One rank of one mode (under torchrun): load, prefill, write every rank's numbers (rank 0)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dbo.bench.hf.prefill_table import logits_match
    from dbo.experts import relative_error
    from dbo.integrations.transformers import DBOPrefill, prefill_logits, prefill_split_config
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.integrations.transformers.ep_model import expert_parallel_modules
    from dbo.integrations.transformers.fsdp import count_all_gathered_bytes
    from dbo.peers.process_group import distributed

    with distributed("cpu") as (rank, world, _):
        rss_after_imports = rss_mib()
        kw = {"distributed_config": ep_distributed_config(args.backend, world)} if args.mode == "ep" else {}
        dist.barrier()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, **kw).eval()
        dist.barrier()
        load_s = time.perf_counter() - t0
        peak_after_load, rss_after_load = peak_rss_mib(), rss_mib()

        def local_bytes(p):
            t = p.to_local() if hasattr(p, "to_local") else p
            return t.numel() * t.element_size()

        expert_bytes = sum(local_bytes(p) for n, p in model.named_parameters() if ".experts." in n)
        ep: dict = {}  # the ep mode's figures: its first prefill and the overlapped one
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
        with torch.inference_mode():
            if args.mode == "ep":
                # as transformers loaded it: the first forward gathers the dense weights once
                with count_all_gathered_bytes() as gathered:
                    t0 = time.perf_counter()
                    prefill_logits(model, ids, logits_to_keep=1)
                    ep["first_forward_s"] = time.perf_counter() - t0
                    ep["first_forward_gathered_bytes"] = sum(gathered)
                    gathered.clear()
                    ep["layers_through_dbo"] = len(expert_parallel_modules(model))
                    t0 = time.perf_counter()
                    logits = DBOPrefill(model, prefill_split_config(adaptive=False),
                                        logits_to_keep=1)(ids)
                    ep["dbo_gathered_bytes"] = sum(gathered)
            else:
                t0 = time.perf_counter()
                logits = prefill_logits(model, ids, logits_to_keep=1)
            prefill_s = time.perf_counter() - t0
        peak_after_prefill = peak_rss_mib()
        checked: dict = {}  # --check: the ep logits against the plain model's
        if args.check and args.mode == "ep":
            del model
            full = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).eval()
            with torch.inference_mode():
                want = prefill_logits(full, ids, logits_to_keep=1)
            rel_err = relative_error(logits, want)
            top1 = (logits[:, -1].argmax(-1) == want[:, -1].argmax(-1)).float().mean().item()
            checked = {"rel_err_vs_plain": rel_err, "top1_agree": top1,
                       "logits_match": logits_match(rel_err, top1, torch.bfloat16)}
        row = LoadRow(mode=args.mode, rank=rank, rss_after_imports_mib=rss_after_imports, load_s=load_s,
                      peak_rss_after_load_mib=peak_after_load, rss_after_load_mib=rss_after_load,
                      expert_bytes=expert_bytes, prefill_s=prefill_s,
                      peak_rss_after_prefill_mib=peak_after_prefill, **ep, **checked)
        rows: list = [None] * world
        dist.all_gather_object(rows, row.to_json())
        if rank == 0:
            write_whole(args.out, json.dumps(rows))


def launch(args: LoadOptions, mode: str, out: Path) -> list[LoadRow]:
    """Run ``mode`` on ``--ranks`` fresh processes; their rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           "-m", "dbo.bench", PROG, "--worker", "--mode", mode, "--dir", args.dir, "--out", str(out),
           "--backend", args.backend, "--batch", str(args.batch), "--seq", str(args.seq)]
    if args.check:
        cmd.append("--check")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a session of its own: a Ctrl-C reaches it once, from here, and torchrun stops its ranks
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        stop_launched(proc)
        raise
    if proc.returncode != 0:
        sys.stderr.write(stdout[-4000:] + stderr[-8000:])
        raise SystemExit(f"{PROG}: {mode} failed (exit {proc.returncode}); its output is above")
    return [LoadRow.from_json(r) for r in json.loads(out.read_text())]


def stop_launched(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a launched torchrun and its ranks: SIGINT to torchrun (its agent passes it on to each
    rank and waits for them), then, past ``grace_s``, SIGKILL to its whole session."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def parse_args(argv: list[str] | None = None) -> LoadOptions:
    """The options of command line ``argv`` (default ``sys.argv[1:]``); bad input ends the
    program in one line, exit code 2."""
    p = ArgumentParser(prog=f"python -m dbo.bench {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the checkpoint (written here if it has none)")
    p.add_argument("--preset", choices=PRESET_CHOICES, default="qwen3-30b-a3b",
                   help="the model written where --dir has none (default: qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--ranks", type=int, default=2, help="processes per mode (default: 2)")
    p.add_argument("--backend", type=backend_name, default="all2all", help="dbo backend of the ep mode "
                   f"(default: all2all; on CPU: {' '.join(cpu_backends())})")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (default: 2)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default: 16)")
    p.add_argument("--check", action="store_true", help="compare the DBO logits with the plain model's")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["plain", "ep"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    try:
        args = LoadOptions(**vars(p.parse_args(argv)))
    except ValueError as exc:
        p.error(str(exc))
    path = Path(args.dir)
    if path.exists() and not path.is_dir():
        p.error(f"--dir {args.dir}: exists and is not a folder, want a folder")
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    else:
        config = model_config(args.preset, args.layers)
    experts = num_routed_experts(config)
    if experts is None or experts % args.ranks:
        p.error(f"--ranks {args.ranks}: the checkpoint's {experts} routed experts do not split evenly; "
                "give a number of ranks that divides it")
    check_writable_folder(p, "--dir", args.dir)
    if args.json:
        check_writable_file(p, "--json", args.json)
    return dataclasses.replace(args, config=config)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        from dbo.integrations.transformers.checkpoint import write_random_checkpoint

        t0 = time.perf_counter()
        write_random_checkpoint(args.config, path, seed=args.seed)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    result = LoadResult(size_gb=size, ranks=args.ranks, backend=args.backend)
    for mode in ("plain", "ep"):
        result.rows += launch(args, mode, path.parent / f".{path.name}.{mode}.json")
    print_table(result, args)
    ok, why = verdict_reason(result.rows, args)
    write_json(result, args.json)
    return verdict(PROG, ok, why)


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
