"""Loading a real-sized checkpoint expert-parallel on CPU: peak RSS and load time per rank.

    python examples/bench_hf_load.py --dir /tmp/qwen3-30b-a3b-2l            # writes it if absent
    python examples/bench_hf_load.py --dir DIR --ranks 2 --backend all2all --json load.json

The checkpoint is Qwen3-30B-A3B's shape (hidden 2048, 128 experts of intermediate 768, top-8,
vocabulary 151936) cut to ``--layers`` decoder layers (2: about 3.6 GB in bf16), random weights,
written once with ``save_pretrained`` by one process. Then, each in fresh processes under
``torchrun --nproc-per-node RANKS`` (peak RSS is a per-process high-water mark):

* ``plain``: every rank ``from_pretrained(DIR, dtype=bf16)``: the whole model on every rank;
* ``ep``: every rank ``from_pretrained(DIR, dtype=bf16, distributed_config=
  ep_distributed_config(BACKEND))``: transformers reads this rank's experts only, dbo's backend
  moves the tokens; then a first prefill under ``torch.inference_mode()`` as loaded (it gathers
  the dense weights once and keeps them whole: ``dbo.integrations.transformers.fsdp``) and one overlapped
  prefill (``DBOPrefill``) of a small batch, checked against the plain model's logits when
  ``--check`` (loads the plain model too, after the measurement).

Each rank reports: RSS after imports, peak RSS (``ru_maxrss``) after loading and after the
first prefill, the load's wall time, and the bytes of routed experts it holds; in ``ep`` mode
also the bytes FSDP2 all-gathers in the first prefill (the dense weights, once) and in the
overlapped prefill after it (none). Safetensors are
memory-mapped: pages of the file a process touched count in its RSS (and are shared with the page
cache), so RSS is what the process touched, not only what it allocated. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak resident set so far (MiB; ``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_checkpoint(path: Path, layers: int, seed: int) -> float:
    """Qwen3-30B-A3B's shape with ``layers`` layers, bf16, N(0, 0.02) weights; returns GB written."""
    import torch

    from dbo.integrations.transformers.presets import causal_lm_class, preset_config

    config = preset_config("qwen3-30b-a3b", layers=layers)
    with torch.device("meta"):
        model = causal_lm_class("qwen3_moe")(config)
    model = model.to(torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for mod in model.modules():  # the rotary embedding's buffers, as its __init__ computes them
            own = dict(mod.named_buffers(recurse=False))
            if "inv_freq" in own:
                fresh = dict(type(mod)(mod.config).named_buffers(recurse=False))
                for bname, buf in own.items():
                    buf.copy_(fresh[bname])
    model.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9


def worker(args: argparse.Namespace) -> None:
    """One rank of one mode (under torchrun)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import dbo.backends.torchdist  # noqa: F401  (binds its all-gather before the spy below)
    from dbo.integrations.transformers import DBOPrefill, prefill_logits
    from dbo.integrations.transformers.ep import ep_distributed_config
    from dbo.integrations.transformers.ep_model import expert_parallel_modules

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"mode": args.mode, "rank": rank, "rss_after_imports_mib": rss_mib()}
    kw = {"distributed_config": ep_distributed_config(args.backend, world)} if args.mode == "ep" else {}
    dist.barrier()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, **kw).eval()
    dist.barrier()
    out["load_s"] = time.perf_counter() - t0
    out["peak_rss_after_load_mib"] = peak_rss_mib()
    out["rss_after_load_mib"] = rss_mib()

    def local_bytes(p):
        t = p.to_local() if hasattr(p, "to_local") else p
        return t.numel() * t.element_size()

    out["expert_bytes"] = sum(local_bytes(p) for n, p in model.named_parameters() if ".experts." in n)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
    with torch.inference_mode():
        if args.mode == "ep":
            # as transformers loaded it: the first forward gathers the dense weights once
            gathered = []
            real = dist.all_gather_single

            def spy(output, inp, *a, **k):
                gathered.append(output.numel() * output.element_size())
                return real(output, inp, *a, **k)

            dist.all_gather_single = spy
            t0 = time.perf_counter()
            prefill_logits(model, ids, logits_to_keep=1)
            out["first_forward_s"] = time.perf_counter() - t0
            out["first_forward_gathered_bytes"] = sum(gathered)
            gathered.clear()
            out["layers_through_dbo"] = len(expert_parallel_modules(model))
            t0 = time.perf_counter()
            logits = DBOPrefill(model, logits_to_keep=1)(ids)
            out["dbo_gathered_bytes"] = sum(gathered)
            dist.all_gather_single = real
        else:
            t0 = time.perf_counter()
            logits = prefill_logits(model, ids, logits_to_keep=1)
        out["prefill_s"] = time.perf_counter() - t0
    out["peak_rss_after_prefill_mib"] = peak_rss_mib()
    if args.check and args.mode == "ep":
        del model
        full = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            want = prefill_logits(full, ids, logits_to_keep=1)
        out["rel_err_vs_plain"] = ((logits.float() - want.float()).norm() / want.float().norm()).item()
        out["top1_agree"] = (logits[:, -1].argmax(-1) == want[:, -1].argmax(-1)).float().mean().item()
    rows: list = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace, mode: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.ranks), str(HERE), "--worker", "--mode", mode, "--dir", args.dir, "--out", str(out),
           "--backend", args.backend, "--batch", str(args.batch), "--seq", str(args.seq)]
    if args.check:
        cmd.append("--check")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{mode} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def report(rows: list[dict], size_gb: float, args: argparse.Namespace) -> None:
    print(f"\n{args.dir}: {size_gb:.2f} GB of bf16 safetensors, {args.ranks} gloo ranks on CPU, "
          f"backend {args.backend}; prefill of {args.batch}x{args.seq} tokens per rank\n")
    print("| mode | rank | load s | RSS after imports MiB | peak RSS after load MiB | peak RSS after "
          "prefill MiB | routed-expert bytes held GB | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['load_s']:.1f} | {r['rss_after_imports_mib']:.0f} | "
              f"{r['peak_rss_after_load_mib']:.0f} | {r['peak_rss_after_prefill_mib']:.0f} | "
              f"{r['expert_bytes'] / 1e9:.2f} | {r['prefill_s']:.2f} |")
    for r in rows:
        if "first_forward_gathered_bytes" in r:
            print(f"rank {r['rank']}: the first prefill as loaded all-gathered "
                  f"{r['first_forward_gathered_bytes'] / 1e9:.2f} GB (the dense weights, kept whole) and "
                  f"took {r['first_forward_s']:.2f} s; then DBOPrefill {r['prefill_s']:.2f} s, "
                  f"{r['dbo_gathered_bytes'] / 1e9:.2f} GB gathered")
    checks = [r for r in rows if "rel_err_vs_plain" in r]
    for r in checks:
        print(f"rank {r['rank']}: DBO logits vs plain model rel err {r['rel_err_vs_plain']:.1e}, "
              f"top-1 agreement {r['top1_agree']:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the checkpoint (written here if it has none)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="all2all", help="dbo backend for the ep mode")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--check", action="store_true", help="compare the DBO logits with the plain model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["plain", "ep"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    path = Path(args.dir)
    if not any(path.glob("*.safetensors")):
        t0 = time.perf_counter()
        size = write_checkpoint(path, args.layers, args.seed)
        print(f"wrote {path}: {size:.2f} GB in {time.perf_counter() - t0:.0f} s")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    rows = []
    for mode in ("plain", "ep"):
        rows += launch(args, mode, path.parent / f".{path.name}.{mode}.json")
    report(rows, size, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"size_gb": size, "ranks": args.ranks,
                                               "backend": args.backend, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
