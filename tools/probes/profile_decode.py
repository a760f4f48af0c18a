"""Where the time of a greedy decode step of a transformers model loaded expert-parallel goes: the
host against the GPU, the host syncs, the kernels and the Python.

    torchrun --nproc-per-node 2 tools/probes/profile_decode.py --device cuda \\
        --checkpoint /tmp/qwen3-30b-a3b-48 --backend deepep_ht/deepep_ll --out out/decode_profile
    torchrun --nproc-per-node 2 tools/probes/profile_decode.py     # CPU, gloo: the tiny Qwen3-MoE

Every rank loads the checkpoint with dbo's implementation of ``--backend`` (``NAME`` or
``PREFILL/DECODE``), warms ``greedy_generate`` up on ``--batch`` prompts of ``--prompt`` tokens,
then times calls of 1 and of ``1 + --steps`` new tokens (the difference: ``--steps`` decode
steps) and profiles one of the latter twice: with ``torch.profiler`` (CPU and CUDA activities)
and with cProfile. Rank 0 prints, per decode step: the wall time; the GPU's busy time (the union
of its kernels' and copies' intervals); the CUDA runtime's host syncs (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, device-to-host copies) and their time; the
kernels with the most GPU time; the Python functions with the most own time. A step whose wall
time is far above its GPU busy time is host-bound, and a sync per layer makes the host wait for
the GPU (the two cannot overlap). It writes the profiler's trace and the cProfile stats to
``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from dbo.bench.cli import ArgumentParser, check_at_least
from dbo.bench.hf.args import add_model_arguments, backend_name, check_model_arguments
from dbo.bench.hf.model import backend_kwargs, load_checkpoint, save_checkpoint
from dbo.integrations.transformers import use_backend
from dbo.integrations.transformers.generate import greedy_generate
from dbo.peers.collectives import all_reduce_max
from dbo.peers.process_group import distributed
from dbo.split import SplitConfig

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _pair(text: str) -> tuple[str, str | None]:
    prefill, _, decode = text.partition("/")
    return backend_name(prefill), backend_name(decode) if decode else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--backend", type=_pair, default=None, metavar="NAME|PREFILL/DECODE",
                   help="(default: deepep_ht/deepep_ll on CUDA, all2all on CPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (CUDA 64, CPU 4)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (CUDA 512, CPU 8)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled (default: 8)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="decode_profile")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.batch = a.batch or (64 if cuda else 4)
    a.prompt = a.prompt or (512 if cuda else 8)
    check_at_least(p, a, 1, "batch", "prompt", "steps", "top")
    if not (a.checkpoint or a.save_checkpoint):
        if cuda:
            p.error("--device cuda: give --checkpoint DIR (or --save-checkpoint DIR to write one)")
        a.save_checkpoint = "profile_decode_ckpt"
    check_model_arguments(p, a)
    a.backend = a.backend or (("deepep_ht", "deepep_ll") if cuda else ("all2all", None))
    return a


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union of ``(start, end)`` intervals (us), in ms."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def _trace_summary(trace: dict, steps: int, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    syncs = [e for e in runtime if e.get("name") in SYNCS]
    d2h = [e for e in gpu if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    kernels: dict[str, float] = {}
    for e in gpu:
        kernels[e["name"]] = kernels.get(e["name"], 0.0) + e.get("dur", 0.0) / 1e3
    return {
        "gpu_busy_ms_per_step": _busy_ms([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in gpu]) / steps,
        "kernels_per_step": len([e for e in gpu if e.get("cat") == "kernel"]) / steps,
        "syncs_per_step": len(syncs) / steps,
        "sync_ms_per_step": sum(e.get("dur", 0.0) for e in syncs) / 1e3 / steps,
        "d2h_copies_per_step": len(d2h) / steps,
        "top_kernels_ms_per_step": sorted(((n, t / steps) for n, t in kernels.items()),
                                          key=lambda x: -x[1])[:top],
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    with distributed(a.device) as (rank, world, device):
        if a.save_checkpoint:
            save_checkpoint(a.config, a.save_checkpoint, a.dtype, device, a.seed, rank)
        prefill, decode = a.backend
        model = load_checkpoint(a.checkpoint, a.dtype, device, backend=prefill)
        decode_kw = None if decode is None else backend_kwargs(decode, max_tokens_per_rank=a.batch)
        use_backend(model, prefill, decode_backend=decode, decode_backend_kwargs=decode_kw,
                    **backend_kwargs(prefill, max_tokens_per_rank=a.batch * a.prompt))
        g = torch.Generator().manual_seed(7 + rank)
        ids = torch.randint(0, a.config.vocab_size, (a.batch, a.prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        plain = SplitConfig(enabled=False)

        def call(tokens: int) -> None:
            greedy_generate(model, ids, mask, max_new_tokens=tokens, config=plain)
            if device.type == "cuda":
                torch.cuda.synchronize()

        def wall_ms(tokens: int, reps: int = 3) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call(tokens)
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[len(times) // 2]

        with torch.inference_mode():
            for tokens in (1, 1 + a.steps):
                call(tokens)  # warm: kernels, the allocator, the shapes
            one, many = all_reduce_max([wall_ms(1), wall_ms(1 + a.steps)], phase="profile_decode")
            step_ms = (many - one) / a.steps
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                call(1 + a.steps)
            out.mkdir(parents=True, exist_ok=True)
            trace_path = out / f"trace_rank{rank}.json"
            prof.export_chrome_trace(str(trace_path))
            cprof = cProfile.Profile()
            cprof.enable()
            call(1 + a.steps)
            cprof.disable()
            cprof.dump_stats(str(out / f"rank{rank}.prof"))
        if rank == 0:
            summary = _trace_summary(json.loads(trace_path.read_text()), 1 + a.steps, a.top)
            report = {"backend": "/".join(x for x in a.backend if x), "world": world, "batch": a.batch,
                      "prompt": a.prompt, "steps": a.steps, "call_1_token_ms": one,
                      "decode_step_wall_ms": step_ms, **summary}
            (out / "summary.json").write_text(json.dumps(report, indent=1))
            print(f"decode step: {step_ms:.2f} ms wall (slowest rank; calls of 1 and {1 + a.steps} new "
                  f"tokens: {one:.1f} / {many:.1f} ms); per step of the profiled call: GPU busy "
                  f"{summary['gpu_busy_ms_per_step']:.2f} ms, {summary['kernels_per_step']:.0f} kernels, "
                  f"{summary['syncs_per_step']:.1f} host syncs ({summary['sync_ms_per_step']:.2f} ms), "
                  f"{summary['d2h_copies_per_step']:.1f} device-to-host copies", flush=True)
            for name, ms in summary["top_kernels_ms_per_step"]:
                print(f"  {ms:8.3f} ms/step  {name[:110]}")
            s = io.StringIO()
            pstats.Stats(cprof, stream=s).sort_stats("tottime").print_stats(a.top)
            print(s.getvalue(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
