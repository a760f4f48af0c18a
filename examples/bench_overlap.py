"""Overlap benchmark: how much of the all-to-all dual-batch overlap hides, per MoE layer.

    # GPUs (2 x H200, NCCL); DeepEP wheels installed (source .whl/prelude.sh)
    torchrun --nproc-per-node 2 examples/bench_overlap.py --device cuda --backend deepep_ht --out DIR
    torchrun --nproc-per-node 2 examples/bench_overlap.py --device cuda --backend deepep_ll \\
        --cuda-graph --out DIR
    # CPU smoke test (gloo, tiny shapes)
    torchrun --nproc-per-node 2 examples/bench_overlap.py --device cpu --backend naive --quick

For each shape of the grid (tokens per rank x routed-expert intermediate size) it builds a
``--layers``-layer MoE model (examples/_bench_layer.py: attention stand-in, router, routed
experts behind the backend, shared expert) and measures per layer:

* compute alone: the same layer with the communication replaced by a replay of what the
  backend delivered (same received tokens, same expert kernels), for each ``--expert-chunks``;
* communication alone: dispatch + combine of the same routing, no experts, for each
  ``--num-sms`` (DeepEP normal mode's ``Buffer.set_num_sms``);
* serial: the plain forward over the whole batch, for each chunking x SM count;
* DBO: two ubatches through ``dbo.overlap.overlapped_forward`` (``run_ubatches``; the backends
  yield around their all-to-all), for each chunking x SM count;
* DBO compute alone: the DBO schedule with the replayed communication (the cost of splitting);

with CUDA events after warm-up, the median over ``--steps`` steps of the slowest rank, the CPU
launch time of a step (and whether the step waits for the GPU from the host), and the peak
memory of one step. Speedup = best serial / best DBO; overlap efficiency = (serial - DBO) /
min(compute, comm) (examples/_bench_report.py has the exact definitions). With ``--cuda-graph``
(deepep_ll) it also captures a whole serial step and a whole DBO step into CUDA graphs and
compares their replays with eager DBO, checking that the outputs are equal.

Every DBO and chunked output is checked against the serial one. Rank 0 writes the bundle to
``--out``: ``bench_overlap.json`` (every measurement and the environment), ``bench_overlap.png``
(matplotlib), ``bench_overlap.trace.json`` (dbo's schedule of one DBO step per shape; open at
https://ui.perfetto.dev), ``gpu_trace_{dbo,serial}.json`` (torch.profiler kernels of one step of
the profiled shape), and prints a short table last. Exits 1 if an output mismatched.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _bench_layer import (  # examples/ is on sys.path
    BenchModel,
    ChunkedSwiGLUExperts,
    IdentityExperts,
    LayerDims,
    RecordingPrepareAndFinalize,
    ReplayPrepareAndFinalize,
)
from _bench_report import format_table, summarize_shape, write_plot
from _bench_timing import Progress, measure, reduce_max
from _model import BACKENDS, make_backend, shutdown_distributed

import dbo
from dbo.autotune import NEVER_SPLIT, autotune_split_config
from dbo.moe import MoEKernel, SwiGLUExperts, relative_error
from dbo.overlap import overlapped_forward
from dbo.split import SplitConfig, Vote, local_vote, plan_ubatches

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
MODES = ("compute", "dbo_compute", "comm", "serial", "dbo")
SCHEMA = "dbo.bench_overlap/1"


# ---- arguments ------------------------------------------------------------------------------


def _opt_int(v: str) -> int | None:
    if v.lower() == "none":
        return None
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {v}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="deepep_ht")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cuda: NCCL on cuda:LOCAL_RANK; cpu: gloo (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank (default: deepep_ll 32..512, else 1024 4096 16384)")
    p.add_argument("--intermediate", type=int, nargs="+", default=None,
                   help="routed expert intermediate sizes, a second grid axis (default: deepep_ll "
                        "2048; else 2048 (DeepSeek-V3) and 512 (communication >= 25%% of a layer))")
    p.add_argument("--shared-intermediate", type=int, default=None,
                   help="shared expert intermediate size (default: the routed one)")
    p.add_argument("--hidden", type=int, default=None, help="default 7168 (cpu: 128)")
    p.add_argument("--experts", type=int, default=None, help="routed experts over all ranks (256)")
    p.add_argument("--topk", type=int, default=None, help="default 8 (cpu: 2)")
    p.add_argument("--attn-width", type=int, default=None,
                   help="attention stand-in width: 4 * tokens * hidden * width flops (4096)")
    p.add_argument("--attn-yield", action="store_true",
                   help="yield inside the attention stand-in too (as examples/_model.py does)")
    p.add_argument("--layers", type=int, default=None,
                   help="MoE layers per step (deepep_ll 4, else 2); times are reported per layer")
    p.add_argument("--expert-chunks", type=int, nargs="+", default=None,
                   help="expert groups launched one after the other (1 2 4 8)")
    p.add_argument("--num-sms", type=int, nargs="+", default=None,
                   help="deepep_ht: SMs for DeepEP's kernels, Buffer.set_num_sms (24 32 48)")
    p.add_argument("--experts-impl", choices=["bench", "project"], default="bench",
                   help="bench: the sync-free chunked experts of _bench_layer; project: "
                        "dbo.moe.SwiGLUExperts (one chunk only)")
    p.add_argument("--ll-rows", default="auto",
                   help="deepep_ll expert rows computed per expert: auto (most tokens any expert "
                        "received, rounded up to 16: a masked grouped GEMM stand-in), full (the "
                        "whole capacity) or a number")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (20)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (3)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="deepep_ll: capture a whole serial and DBO step into CUDA graphs and replay")
    p.add_argument("--profile-shape", default="auto",
                   help="TOKENS:INTERMEDIATE whose best serial and DBO steps are profiled with "
                        "torch.profiler, 'auto' or 'none'")
    p.add_argument("--sm-carveout", type=int, default=None,
                   help="torch._C._set_sm_carveout_experimental(N) for every run (experiment)")
    p.add_argument("--dbo-sm-carveout", type=_opt_int, nargs="+", default=None,
                   help="SM carve-outs tried for the DBO runs only (overlapped_forward's "
                        "sm_carveout: matmuls and grouped GEMMs leave N SMs to DeepEP), e.g. "
                        "'none 24 48' (default: none)")
    p.add_argument("--no-autotune", dest="autotune", action="store_false",
                   help="skip dbo.autotune (by default, after each intermediate size's shapes, "
                        "the thresholds are tuned over the grid's token counts and the wrapper "
                        "is timed with the tuned config at every shape)")
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    p.add_argument("--fake-deep-ep", action="store_true",
                   help="testing: run the DeepEP backends on dbo.testing's fake deep_ep (CPU, gloo); "
                        "exercises the code paths, the numbers mean nothing")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip what is left after this many seconds (default 280 on cuda, none on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_overlap_out", help="directory of the bundle")
    args = p.parse_args(argv)
    resolve_defaults(args)
    for name in ("hidden", "experts", "topk", "attn_width", "layers", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.tokens) < 2 or min(args.intermediate) < 1 or min(args.expert_chunks) < 1:
        p.error("--tokens must be >= 2 (two ubatches), --intermediate and --expert-chunks >= 1")
    if any(s % 2 for s in args.num_sms):
        p.error("--num-sms values must be even (DeepEP)")
    if args.topk > args.experts:
        p.error("--topk must be <= --experts")
    if args.ll_rows not in ("auto", "full") and not args.ll_rows.isdigit():
        p.error("--ll-rows must be auto, full or a number")
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the arguments left at None: tiny shapes on the CPU, DeepSeek-V3 sizes on GPUs."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu, quick = args.device == "cpu", args.quick
    ll, ht = args.backend == "deepep_ll", args.backend == "deepep_ht"
    if cpu:
        # DeepEP's combine is bf16 only (the --fake-deep-ep runs keep its checks)
        dtype = "bfloat16" if args.backend.startswith("deepep") else "float32"
        d = dict(dtype=dtype, hidden=128, experts=8, topk=2, attn_width=128, layers=2,
                 tokens=[64] if quick else [64, 256], intermediate=[64], expert_chunks=[1, 2],
                 steps=3 if quick else 10, warmup=1, time_budget_s=0.0)
    else:
        # decode steps are short: more layers per step (the CUDA graph captures "several")
        d = dict(dtype="bfloat16", hidden=7168, experts=256, topk=8, attn_width=4096,
                 layers=4 if ll else 2,
                 steps=20, warmup=3, time_budget_s=280.0,
                 expert_chunks=[1, 8] if quick else [1, 2, 4, 8])
        if ll:
            d.update(tokens=[64, 256] if quick else [32, 64, 128, 256, 512], intermediate=[2048])
        else:
            d.update(tokens=[4096] if quick else [1024, 4096, 16384],
                     intermediate=[512] if quick else [2048, 512])
    d["num_sms"] = ([24] if quick else [24, 32, 48]) if ht and not cpu else []
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if not ht:
        args.num_sms = []
    if args.experts_impl == "project":
        args.expert_chunks = [1]
    if args.dbo_sm_carveout is None:
        args.dbo_sm_carveout = [None]


# ---- process group and environment ---------------------------------------------------------


def init_distributed(device: str) -> tuple[int, int, int]:
    """Join the torchrun group (or start a one-rank group); return rank, world, local rank."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank


def collect_env(args: argparse.Namespace, device: torch.device, world: int) -> dict[str, Any]:
    env: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv, "python": platform.python_version(), "hostname": socket.gethostname(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "world_size": world,
        "dbo": getattr(dbo, "__version__", None),
        "env_vars": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith(("NVSHMEM_", "NCCL_", "CUDA_DEVICE_MAX", "DBO_", "OMP_NUM",
                                      "TORCH_NCCL", "TORCH_SYMM"))},
    }
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, sm_count=props.multi_processor_count,
                   gpu_memory_bytes=props.total_memory, nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        env.update(device_name=f"cpu ({os.cpu_count()} cores)", sm_count=None)
    if args.backend.startswith("deepep"):
        from dbo.backends.deepep_buffer import detect_deep_ep_api
        env["deep_ep"] = detect_deep_ep_api().describe()
    for mod in ("matplotlib", "tqdm"):
        try:
            __import__(mod)
            env[mod] = True
        except ImportError:
            env[mod] = False
    return env


# ---- helpers ----------------------------------------------------------------------------------


class Budget:
    """Wall-time budget, checked collectively so every rank skips the same configurations."""

    def __init__(self, seconds: float, device: torch.device):
        self.seconds = seconds
        self.device = device
        self.t0 = time.perf_counter()
        self.hit = False

    def expired(self) -> bool:
        if self.seconds <= 0:
            return False
        if not self.hit:
            self.hit = reduce_max([time.perf_counter() - self.t0], self.device)[0] > self.seconds
        return self.hit


def compare(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> dict[str, float]:
    """``rel``: ||out - ref|| / ||ref||; ``token_median``: the median over tokens of each
    token's relative error (MAX over ranks). In bf16 a one-ulp difference between a ubatch's
    and the whole batch's matmuls can flip a near-tie in a later layer's top-k routing and
    change that token's output entirely; the median ignores those few tokens, not a broken
    step (which breaks most of them)."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    tok = torch.linalg.vector_norm(o - r, dim=-1) / torch.linalg.vector_norm(r, dim=-1).clamp_min(1e-30)
    med = tok.median().item() if tok.numel() else 0.0
    if not torch.isfinite(o).all():
        med = float("inf")
    rel, med = reduce_max([relative_error(out, ref), med], device)
    return {"rel": rel, "token_median": med}


def max_rel_error(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> float:
    return reduce_max([relative_error(out, ref)], device)[0]


def _set_rows(experts: dict[int, Any], rows: int | None) -> None:
    for e in experts.values():
        if isinstance(e, ChunkedSwiGLUExperts):
            e.rows = rows


def _round_rows(n: int, cap: int) -> int:
    return max(16, min(cap, -(-n // 16) * 16))


class SMs:
    """DeepEP normal mode's SM count (a class attribute of ``deep_ep.Buffer``)."""

    def __init__(self, backend: Any):
        buf = getattr(backend, "buffer", None)
        self.cls = type(buf) if buf is not None and hasattr(type(buf), "set_num_sms") else None
        self.default = getattr(self.cls, "num_sms", None)

    def set(self, n: int | None) -> None:
        if self.cls is not None and n is not None and getattr(self.cls, "num_sms", None) != n:
            self.cls.set_num_sms(n)


def configure_deepep(args: argparse.Namespace) -> dict[str, Any]:
    """Before any DeepEP buffer exists: size it for the largest SM count and token count.
    Returns what it found and changed (for the bundle's environment)."""
    found: dict[str, Any] = {}
    if args.backend == "deepep_ll":
        need = (max(args.tokens) + 1) * 2
        if int(os.environ.get("NVSHMEM_QP_DEPTH", "1024")) < need:
            # DeepEP asserts NVSHMEM_QP_DEPTH >= (max_tokens_per_rank + 1) * 2 (default 1024)
            os.environ["NVSHMEM_QP_DEPTH"] = str(1 << (need - 1).bit_length())
            found["set_NVSHMEM_QP_DEPTH"] = os.environ["NVSHMEM_QP_DEPTH"]
    if args.backend == "deepep_ht":
        from dbo.backends.deepep_buffer import detect_deep_ep_api
        api = detect_deep_ep_api()
        found["deep_ep_default_num_sms"] = api.buffer_cls.num_sms
        if args.num_sms:
            # the normal-mode buffer is sized by Buffer.num_sms when created: size it for the most
            api.buffer_cls.set_num_sms(max(args.num_sms))
    return found


def count_configs(args: argparse.Namespace) -> int:
    c, s = len(args.expert_chunks), max(1, len(args.num_sms))
    per = {"compute": c, "dbo_compute": c, "comm": s, "serial": c * s,
           "dbo": c * s * len(args.dbo_sm_carveout)}
    n = sum(per[m] for m in args.modes) + 1  # +1: traces
    if args.cuda_graph:
        n += 1
    if args.autotune:
        n += 1  # the wrapper with the tuned config (the tuning itself: one more per size)
    return n * len(args.tokens) * len(args.intermediate) + (len(args.intermediate) if args.autotune else 0)


def profile_target(args: argparse.Namespace) -> tuple[int, int] | None:
    if args.profile_shape == "none":
        return None
    if args.profile_shape == "auto":
        toks = sorted(args.tokens)
        t = toks[-1] if args.backend == "deepep_ll" else toks[len(toks) // 2]
        return t, min(args.intermediate)
    t, i = args.profile_shape.split(":")
    return int(t), int(i)


# ---- one shape ------------------------------------------------------------------------------


class ShapeBench:
    """Every measurement of one (tokens, intermediate) shape on an existing model."""

    def __init__(self, args: argparse.Namespace, model: BenchModel, backend: Any, tokens: int,
                 device: torch.device, rank: int, progress: Progress, budget: Budget,
                 dbo_backend: Any = None):
        self.args, self.model, self.pf, self.T = args, model, backend, tokens
        #: the backend of the DBO runs: deepep_ll's is sized for one ubatch (its capacity is the
        #: most tokens one dispatch sends), as an engine running DBO would size it
        self.pf_dbo = backend if dbo_backend is None else dbo_backend
        self.device, self.rank, self.progress, self.budget = device, rank, progress, budget
        self.layers = model.dims.layers
        self.tol = TOLERANCE[model.dims.dtype]
        self.sms = SMs(backend)
        self.rec: dict[str, Any] = {"backend": args.backend, "tokens": tokens,
                                    "intermediate": model.dims.intermediate,
                                    "shared_intermediate": model.dims.shared_intermediate,
                                    "layers": self.layers, "measurements": [], "checks": {},
                                    "warnings": []}
        g = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank + 1)
        self.x = torch.randn(tokens, model.dims.hidden, generator=g, device=device,
                             dtype=torch.float32).to(model.dims.dtype)
        self.plan = plan_ubatches(tokens, SplitConfig(num_ubatches=2, decode_token_threshold=1,
                                                      prefill_token_threshold=1))
        if args.experts_impl == "project":
            self.experts: dict[int, Any] = {1: SwiGLUExperts()}
        else:
            self.experts = {c: ChunkedSwiGLUExperts(c) for c in args.expert_chunks}
        self.rows: dict[str, int | None] = {"serial": None, "dbo": None}
        self.carveout: int | None = None  #: the DBO runs' sm_carveout
        self.batched = backend.activation_format.name == "BATCHED_EXPERTS"

    # -- steps --

    def serial(self) -> torch.Tensor:
        return self.model(self.x)

    def dbo(self, trace: dbo.Trace | None = None) -> torch.Tensor:
        return overlapped_forward(self.model, self.x, plan=self.plan, trace=trace,
                                  sm_carveout=self.carveout)

    def use(self, backend: Any, chunks: int, mode: str) -> None:
        if mode.startswith("dbo") and backend is self.pf:
            backend = self.pf_dbo
        self.model.use(backend, self.experts[chunks])
        _set_rows(self.experts, self.rows["dbo" if mode.startswith("dbo") else "serial"])

    def _label(self, mode: str, chunks: int | None, sms: int | None,
               carveout: int | None = None) -> str:
        s = f"T={self.T} I={self.model.dims.intermediate} {mode}"
        if chunks is not None:
            s += f" c{chunks}"
        if sms is not None:
            s += f" s{sms}"
        if carveout is not None:
            s += f" k{carveout}"
        return s

    def run_config(self, mode: str, chunks: int | None, sms: int | None, step: Callable[[], Any],
                   check: Callable[[torch.Tensor], None] | None = None,
                   carveout: int | None = None) -> dict | None:
        entry = {"mode": mode, "expert_chunks": chunks, "num_sms": sms, "sm_carveout": carveout}
        if self.budget.expired():
            entry["skipped"] = "time budget"
            self.rec["measurements"].append(entry)
            self.progress.update(self._label(mode, chunks, sms, carveout) + " (skipped)")
            return None
        if check is not None:
            check(step())
        timing = measure(step, warmup=self.args.warmup, steps=self.args.steps, device=self.device)
        entry["timing"] = timing.to_json()
        self.rec["measurements"].append(entry)
        self.progress.update(self._label(mode, chunks, sms, carveout))
        return entry

    def _check_against(self, ref: torch.Tensor, name: str) -> Callable[[torch.Tensor], None]:
        def check(out: torch.Tensor) -> None:
            err = compare(out, ref, self.device)
            self.rec["checks"][name] = err
            if not err["token_median"] <= self.tol:
                self.rec["warnings"].append(
                    f"T={self.T} I={self.model.dims.intermediate}: {name} differs from the serial "
                    f"output (median token rel err {err['token_median']:.3e} > {self.tol:g}; "
                    f"overall {err['rel']:.3e})")
        return check

    # -- phases --

    def reference(self) -> None:
        """Serial and DBO outputs with one chunk; the LL row bound; their agreement."""
        self.sms.set(self.args.num_sms[0] if self.args.num_sms else None)
        first = min(self.experts)
        e = self.experts[first]
        self.use(self.pf, first, "serial")
        if isinstance(e, ChunkedSwiGLUExperts):
            e.observe = True
        self.serial()  # warm-up (the LL buffer layout, cuBLAS handles)
        self.dbo()
        if isinstance(e, ChunkedSwiGLUExperts) and self.batched and self.args.ll_rows != "full":
            if self.args.ll_rows == "auto":
                for mode, fn, pf in (("serial", self.serial, self.pf), ("dbo", self.dbo, self.pf_dbo)):
                    self.use(pf, first, mode)
                    cap = pf.max_num_tokens_per_rank() * pf.num_dispatchers()
                    e.max_rows_seen = None
                    fn()
                    seen = int(reduce_max([float(e.max_rows_seen.item())], self.device)[0])
                    self.rows[mode] = _round_rows(seen, cap)
            else:
                self.rows = {"serial": int(self.args.ll_rows), "dbo": int(self.args.ll_rows)}
        if isinstance(e, ChunkedSwiGLUExperts):
            e.observe = False
        self.rec["ll_rows"] = dict(self.rows) if self.batched else None
        self.use(self.pf, first, "serial")
        self.ref = self.serial()
        self.use(self.pf, first, "dbo")
        self.ref_dbo = self.dbo()
        self._check_against(self.ref, "dbo_vs_serial")(self.ref_dbo)
        self.rec["plan"] = str(self.plan)

    def compute_alone(self) -> None:
        modes = self.args.modes
        if "compute" not in modes and "dbo_compute" not in modes:
            return
        first = min(self.experts)
        records: dict[str, dict] = {}
        for mode, fn in (("serial", self.serial), ("dbo", self.dbo)):
            recorder = RecordingPrepareAndFinalize(self.pf_dbo if mode == "dbo" else self.pf)
            self.use(recorder, first, mode)
            recorder.begin_step()
            fn()
            records[mode] = recorder.records
        for c in self.experts:
            for mode, src, fn in (("compute", "serial", self.serial), ("dbo_compute", "dbo", self.dbo)):
                if mode not in modes:
                    continue
                replay = ReplayPrepareAndFinalize(self.pf_dbo if src == "dbo" else self.pf,
                                                  records[src])
                self.use(replay, c, mode)

                def step(replay=replay, fn=fn) -> torch.Tensor:
                    replay.begin_step()
                    return fn()

                self.run_config(mode, c, None, step)
        records.clear()

    def comm_alone(self) -> None:
        if "comm" not in self.args.modes:
            return
        self.use(self.pf, min(self.experts), "serial")
        routing = self.model.record_routing(self.x)
        ident = IdentityExperts()
        kernels = [MoEKernel(self.pf, ident) for _ in range(self.layers)]
        step = self.model.comm_step(kernels, routing)
        for s in self.args.num_sms or [None]:
            self.sms.set(s)
            self.run_config("comm", None, s, step)

    def serial_and_dbo(self) -> None:
        for s in self.args.num_sms or [None]:
            self.sms.set(s)
            for c in self.experts:
                if "serial" in self.args.modes:
                    self.use(self.pf, c, "serial")
                    self.run_config("serial", c, s, self.serial,
                                    self._check_against(self.ref, f"serial_c{c}_s{s}"))
                if "dbo" in self.args.modes:
                    for k in self.args.dbo_sm_carveout:
                        self.use(self.pf_dbo, c, "dbo")
                        self.carveout = k
                        self.run_config("dbo", c, s, self.dbo,
                                        self._check_against(self.ref, f"dbo_c{c}_s{s}" + (
                                            "" if k is None else f"_k{k}")),
                                        carveout=k)
                    self.carveout = None

    def best(self, mode: str) -> tuple[int, int | None, int | None]:
        """The chunks, DeepEP SM count and SM carve-out of the fastest ``mode`` run."""
        cands = [m for m in self.rec["measurements"] if m["mode"] == mode and m.get("timing")]
        if not cands:
            return min(self.experts), (self.args.num_sms[0] if self.args.num_sms else None), None
        m = min(cands, key=lambda m: m["timing"]["median_ms"])
        return m["expert_chunks"], m["num_sms"], m.get("sm_carveout")

    def use_best(self, mode: str) -> int:
        """Run the next ``mode`` steps ("serial" or "dbo") in its fastest configuration;
        returns its expert chunks."""
        c, s, k = self.best(mode)
        self.sms.set(s)
        self.use(self.pf, c, mode)
        self.carveout = k if mode == "dbo" else None
        return c

    def adaptive_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model's forward with each mode's best configuration: the one DBO measured best
        inside a run, the one serial measured best outside (what a tuned wrapper runs).

        The kernels of both configurations are built once here and swapped in per call, so a
        call costs what the serial and DBO measurements cost (a fresh ``MoEKernel`` per call
        would allocate its per-ubatch workspaces again every step).
        """
        (c_ser, s_ser, _), (c_dbo, s_dbo, cv_dbo) = self.best("serial"), self.best("dbo")
        self.use(self.pf, c_ser, "serial")
        k_ser = self.model.kernels
        self.use(self.pf, c_dbo, "dbo")
        k_dbo = self.model.kernels
        rows_ser, rows_dbo = self.rows["serial"], self.rows["dbo"]
        model, experts, sms = self.model, self.experts, self.sms
        # the best DBO run's carve-out, set per call (the global setting is one int; every
        # call sets it, so it cannot go stale between plain and overlapped calls)
        cv_ser = self.args.sm_carveout
        carve = (torch._C._set_sm_carveout_experimental
                 if self.args.dbo_sm_carveout != [None] else None)

        def fn(x: torch.Tensor) -> torch.Tensor:
            in_dbo = dbo.dbo_enabled()
            sms.set(s_dbo if in_dbo else s_ser)  # a no-op unless it changes
            if carve is not None:
                carve(cv_dbo if in_dbo else cv_ser)
            model.kernels = k_dbo if in_dbo else k_ser
            _set_rows(experts, rows_dbo if in_dbo else rows_ser)
            return model(x)

        return fn

    def wrapper(self, config: SplitConfig, group: Any, rounds: int = 3) -> None:
        """Time the overlapped forward with ``config`` deciding (one all-reduce per step over
        ``group``, a gloo group on GPUs so that the decision does not wait for the GPU).

        Paired with the plain forward of the best serial configuration: the two alternate for
        ``rounds`` rounds and each keeps its best median ("wrapper", "serial_paired"), so their
        ratio is not a drift between two moments of the run (the GPU's clocks move by a few
        percent over minutes); the order alternates too."""
        if self.budget.expired():
            self.rec["measurements"].append({"mode": "wrapper", "skipped": "time budget"})
            self.progress.update(self._label("wrapper", None, None) + " (skipped)")
            return
        fn = self.adaptive_forward()
        decode = self.args.backend == "deepep_ll"

        def wrapped() -> torch.Tensor:
            return overlapped_forward(fn, self.x, config=config, decode_only=decode, group=group)

        self._check_against(self.ref, "wrapper")(wrapped())
        best: dict[str, Any] = {}
        pair = [("serial_paired", lambda: fn(self.x)), ("wrapper", wrapped)]
        for r in range(rounds):
            for mode, step in (pair if r % 2 == 0 else pair[::-1]):  # neither always goes first
                t = measure(step, warmup=self.args.warmup, steps=self.args.steps, device=self.device)
                if mode not in best or t.median_ms < best[mode].median_ms:
                    best[mode] = t
        for mode, t in best.items():
            self.rec["measurements"].append({"mode": mode, "expert_chunks": None, "num_sms": None,
                                             "sm_carveout": None, "rounds": rounds,
                                             "timing": t.to_json()})
        self.progress.update(self._label("wrapper", None, None))

    def traces(self, profile: bool, out_dir: Path) -> dict | None:
        """One DBO step recorded by dbo.Trace (returned as Chrome JSON); on the profiled shape
        torch.profiler kernel traces of the best DBO and serial steps."""
        self.use_best("dbo")
        trace = dbo.Trace()
        self.dbo(trace=trace)
        files = {}
        if profile and self.device.type == "cuda":
            for mode in ("dbo", "serial"):
                self.use_best(mode)
                fn = self.dbo if mode == "dbo" else self.serial
                fn()
                torch.cuda.synchronize()
                path = out_dir / f"gpu_trace_{mode}.json"
                prof = None
                if self.rank == 0:
                    try:
                        from torch.profiler import ProfilerActivity, profile
                        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                        prof.__enter__()
                    except Exception as exc:  # noqa: BLE001 - a profile is a bonus, never fatal
                        prof = None
                        self.rec["warnings"].append(f"torch.profiler failed: {type(exc).__name__}: {exc}")
                fn()  # every rank runs the step: its collectives must match
                torch.cuda.synchronize()
                if prof is not None:
                    try:
                        prof.__exit__(None, None, None)
                        out_dir.mkdir(parents=True, exist_ok=True)
                        prof.export_chrome_trace(str(path))
                        files[f"gpu_trace_{mode}"] = path.name
                    except Exception as exc:  # noqa: BLE001
                        self.rec["warnings"].append(f"torch.profiler failed: {type(exc).__name__}: {exc}")
        self.rec["trace_files"] = files
        self.progress.update(self._label("traces", None, None))
        return trace.to_chrome() if self.rank == 0 else None

    def cuda_graph(self) -> None:
        """Capture a whole serial step and a whole DBO step; replay; compare with eager."""
        res: dict[str, Any] = {"ok": False}
        self.rec["cuda_graph"] = res
        if self.budget.expired():
            res["error"] = "skipped: time budget"
            self.progress.update(self._label("cuda graph", None, None) + " (skipped)")
            return
        graphs: list[Any] = []
        try:
            outs = {}
            for mode in ("serial", "dbo"):
                c = self.use_best(mode)
                fn = self.serial if mode == "serial" else self.dbo
                eager = fn()
                res[f"eager_{mode}_ms"] = measure(fn, warmup=1, steps=self.args.steps, device=self.device,
                                                  memory=False).median_ms / self.layers
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                dist.barrier()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    static_out = fn()
                graphs.append(g)
                g.replay()
                torch.cuda.synchronize()
                res[f"{mode}_replay_rel_err"] = max_rel_error(static_out, eager, self.device)
                res[f"{mode}_replay_bitwise_equal"] = bool(
                    reduce_max([0.0 if torch.equal(static_out, eager) else 1.0], self.device)[0] == 0.0)
                timing = measure(g.replay, warmup=2, steps=self.args.steps, device=self.device)
                res[f"graph_{mode}_ms"] = timing.median_ms / self.layers
                res[f"graph_{mode}_timing"] = timing.to_json()
                res[f"{mode}_chunks"] = c
                outs[mode] = static_out
            res["dbo_vs_serial_rel_err"] = max_rel_error(outs["dbo"], outs["serial"], self.device)
            res["dbo_replay_equals_eager"] = res["dbo_replay_rel_err"] <= self.tol
            res["graph_dbo_over_serial"] = res["graph_dbo_ms"] / res["graph_serial_ms"]
            res["graph_serial_over_dbo"] = res["graph_serial_ms"] / res["graph_dbo_ms"]
            res["eager_dbo_over_graph_dbo"] = res["eager_dbo_ms"] / res["graph_dbo_ms"]
            res["ok"] = True
            for mode in ("serial", "dbo"):
                if res[f"{mode}_replay_rel_err"] > self.tol:
                    self.rec["warnings"].append(f"T={self.T}: the replayed {mode} graph differs from "
                                                f"eager (rel err {res[f'{mode}_replay_rel_err']:.3e})")
        except Exception as exc:  # noqa: BLE001 - report what prevented capture, keep the bundle
            res["error"] = f"{type(exc).__name__}: {exc}"
            self.rec["warnings"].append(f"T={self.T}: CUDA graph capture/replay failed: {res['error']}")
            try:
                torch.cuda.synchronize()
                # an aborted capture advanced DeepEP's host-side buffer index without running the
                # kernels: clean both low-latency buffers (collective; the failure is symmetric)
                pf = self.pf
                pf.buffer.clean_low_latency_buffer(pf.max_tokens_per_rank, pf.padded_hidden,
                                                   pf.num_experts)
                torch.cuda.synchronize()
            except Exception as exc2:  # noqa: BLE001 - a sticky CUDA error: nothing more can run
                res["error"] += f"; then {type(exc2).__name__}: {exc2}"
                raise
        finally:
            graphs.clear()
            self.pf.reset()
            self.pf_dbo.reset()
        self.progress.update(self._label("cuda graph", None, None))


# ---- the run --------------------------------------------------------------------------------


def tune_and_time_wrapper(args: argparse.Namespace, benches: list[ShapeBench], budget: Budget,
                          progress: Progress, group: Any) -> dict:
    """dbo.autotune over the measured token counts of one model, then the wrapper with the
    tuned config at every shape; each shape's summary is recomputed with that wrapper time."""
    ready = [sb for sb in benches if "skipped" not in sb.rec and hasattr(sb, "ref")]
    res: dict[str, Any] = {"ok": False}
    if budget.expired() or not ready:
        res["error"] = "skipped: time budget" if ready else "no measured shape"
        progress.update("autotune (skipped)")
        return res
    by_tokens = {sb.T: sb for sb in ready}

    forwards = {t: sb.adaptive_forward() for t, sb in by_tokens.items()}
    current: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def make_inputs(t: int) -> list[torch.Tensor]:
        current[:] = [forwards[t]]
        return [by_tokens[t].x]

    def fn(x: torch.Tensor) -> torch.Tensor:
        return current[0](x)

    decode = args.backend == "deepep_ll"
    result = autotune_split_config(fn, make_inputs, sorted(by_tokens), decode_only=decode,
                                   group=group, warmup=args.warmup, steps=max(5, args.steps // 2))
    for sb in ready:
        sb.pf.reset()
        sb.pf_dbo.reset()
    progress.update(f"I={ready[0].model.dims.intermediate} autotune")
    res.update(ok=True, decode_only=decode, threshold=result.threshold,
               never_split=result.threshold >= NEVER_SPLIT, margin=result.margin,
               rows=[dataclasses.asdict(r) for r in result.rows], table=result.table())
    for sb in ready:
        sb.wrapper(result.config, group)
        sb.pf.reset()
        sb.pf_dbo.reset()
        splits = local_vote(sb.T, result.config, decode_only=decode).vote is Vote.YES
        sb.rec["summary"] = summarize_shape(sb.rec, splits)
        sb.rec["summary"]["wrapper_config"] = "autotuned"
    if args.dbo_sm_carveout != [None]:  # the adaptive forward set it per call
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    return res


def build_backend(args: argparse.Namespace, tokens: int, device: torch.device, dtype: torch.dtype) -> Any:
    return make_backend(args.backend, None, hidden=args.hidden, num_experts=args.experts,
                        topk=args.topk, max_tokens_per_rank=tokens, dtype=dtype, device=device)


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device, out_dir: Path,
        env: dict) -> dict:
    dtype = DTYPES[args.dtype]
    budget = Budget(args.time_budget_s, device)
    progress = Progress(count_configs(args), enabled=rank == 0)
    warnings: list[str] = []
    if args.sm_carveout is not None:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            warnings.append("--sm-carveout: this torch has no _set_sm_carveout_experimental")
        else:
            setter(args.sm_carveout)
    # one backend for every shape, except deepep_ll whose capacity is the batch: the first one
    # built is the largest, so the shared DeepEP buffer is sized once
    shared_backend = build_backend(args, max(args.tokens), device, dtype)
    target = profile_target(args)
    shapes, chrome = [], []
    tuned: dict[int, dict] = {}
    # The split decision's all-reduce over NCCL would read its result back on the host, i.e.
    # wait for the GPU every step: decide over a CPU (gloo) group instead, as an engine would.
    decision_group = dist.new_group(backend="gloo") if args.autotune and device.type == "cuda" else None
    try:
        for inter in args.intermediate:
            dims = LayerDims(hidden=args.hidden, intermediate=inter,
                             shared_intermediate=args.shared_intermediate or inter,
                             num_experts=args.experts, topk=args.topk, attn_width=args.attn_width,
                             layers=args.layers, dtype=dtype, attn_yield=args.attn_yield)
            model = BenchModel(dims, rank, world, device, seed=args.seed)
            benches: list[ShapeBench] = []
            for tokens in args.tokens:
                backend = shared_backend
                if args.backend == "deepep_ll" and tokens != max(args.tokens):
                    backend = build_backend(args, tokens, device, dtype)
                dbo_backend = None
                if args.backend == "deepep_ll":
                    dbo_backend = build_backend(args, -(-tokens // 2), device, dtype)
                sb = ShapeBench(args, model, backend, tokens, device, rank, progress, budget,
                                dbo_backend)
                sb.rec["flops_per_token_per_layer"] = dims.flops_per_token()
                if not budget.expired():
                    sb.reference()
                    sb.compute_alone()
                    sb.comm_alone()
                    sb.serial_and_dbo()
                    trace = sb.traces(target == (tokens, inter), out_dir)
                    if trace is not None:
                        chrome.append((f"{args.backend} T={tokens} I={inter}", trace))
                    if args.cuda_graph:
                        if device.type == "cuda" and args.backend == "deepep_ll":
                            sb.cuda_graph()
                        else:
                            sb.rec["cuda_graph"] = {"ok": False, "error": "--cuda-graph needs "
                                                    "--device cuda and --backend deepep_ll"}
                            progress.update("cuda graph (n/a)")
                else:
                    sb.rec["skipped"] = "time budget"
                backend.reset()
                sb.pf_dbo.reset()
                sb.rec["expert_host_count_reads"] = sum(
                    e.host_count_reads for e in sb.experts.values() if isinstance(e, ChunkedSwiGLUExperts))
                decode = args.backend == "deepep_ll"
                splits = local_vote(tokens, SplitConfig(), decode_only=decode).vote is Vote.YES
                sb.rec["summary"] = summarize_shape(sb.rec, splits)
                shapes.append(sb.rec)
                benches.append(sb)
                if rank == 0:  # what is done so far survives a later crash or kill
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / "bench_overlap.json").write_text(json.dumps(
                        {"schema": SCHEMA, "partial": True, "env": env, "args": _jsonable(vars(args)),
                         "shapes": shapes}, indent=1, default=str))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if args.autotune:
                tuned[inter] = tune_and_time_wrapper(args, benches, budget, progress, decision_group)
            del model, benches
    finally:
        progress.close()
    if budget.hit:
        warnings.append(f"time budget of {args.time_budget_s:.0f} s reached: some configurations "
                        "were skipped (see 'skipped' in the JSON)")
    bundle = {"schema": SCHEMA, "partial": False, "env": env, "args": _jsonable(vars(args)), "shapes": shapes,
              "autotune": {str(k): v for k, v in tuned.items()}, "warnings": warnings, "files": {}}
    finish(bundle, chrome, out_dir, rank)
    return bundle


def _jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v))
            for k, v in d.items()}


def _crossovers(bundle: dict) -> list[dict]:
    out = []
    for inter in bundle["args"]["intermediate"]:
        rows = sorted((sh for sh in bundle["shapes"] if sh["intermediate"] == inter),
                      key=lambda sh: sh["tokens"])
        res: dict[str, Any] = {"intermediate": inter}
        for kind, get in (("eager", lambda sh: (sh.get("summary") or {}).get("speedup")),
                          ("graph", lambda sh: (sh.get("cuda_graph") or {}).get("graph_serial_over_dbo"))):
            vals = [(sh["tokens"], get(sh)) for sh in rows]
            if all(v is None for _, v in vals):
                continue
            start = None
            for t, v in reversed(vals):
                if v is None or v <= 1.0:
                    break
                start = t
            res[kind] = start
        out.append(res)
    return out


def finish(bundle: dict, chrome: list[tuple[str, dict]], out_dir: Path, rank: int) -> None:
    """Shape warnings, the crossover, the files and the table (rank 0 writes)."""
    w = bundle["warnings"]
    for sh in bundle["shapes"]:
        label = f"T={sh['tokens']} I={sh['intermediate']}"
        w.extend(sh.get("warnings", []))
        s = sh.get("summary") or {}
        for m in sh["measurements"]:
            t = m.get("timing")
            if t and t["cpu_bound"]:
                w.append(f"{label} {m['mode']} c{m['expert_chunks']} s{m['num_sms']}: CPU launch time "
                         f"{t['cpu_launch_held_ms'] or t['cpu_launch_ms']:.2f} ms is over 80% of the GPU "
                         f"time {t['median_ms']:.2f} ms: Python, not the GPU, sets the pace")
        if sh.get("expert_host_count_reads") and bundle["env"].get("sm_count"):
            w.append(f"{label}: the experts read the expert counts back from the GPU "
                     f"{sh['expert_host_count_reads']} times (the backend gave no host-side counts)")
        synced = sorted({m["mode"] for m in sh["measurements"] if (m.get("timing") or {}).get("host_sync")})
        if synced:
            w.append(f"{label}: steps of {', '.join(synced)} wait for the GPU from the host (launch time "
                     "includes those waits; see cpu_launch_* in the JSON)")
        if s.get("peak_ratio") is not None and s["peak_ratio"] > 1.1:
            w.append(f"{label}: DBO peak memory is {s['peak_ratio']:.2f}x the serial peak (target <= 1.1)")
        if s.get("wrapper_vs_serial") is not None and s["wrapper_vs_serial"] > 1.02:
            who = ("the wrapper with the autotuned config" if s.get("wrapper_measured")
                   else "the default SplitConfig")
            w.append(f"{label}: {who} is {100 * (s['wrapper_vs_serial'] - 1):.0f}% slower than "
                     "serial (limit 2%)")
        share, eff = s.get("comm_share"), s.get("efficiency")
        if share is not None and eff is not None and share >= 0.25 and eff < 0.6:
            w.append(f"{label}: communication is {100 * share:.0f}% of the serial layer and the overlap "
                     f"efficiency is {eff:.2f} (target >= 0.6)")
    bundle["crossover"] = _crossovers(bundle) if bundle["args"]["backend"] == "deepep_ll" else None
    if rank != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    files = bundle["files"]
    if chrome:
        events: list[dict] = []
        for pid, (name, tr) in enumerate(chrome):
            for e in tr["traceEvents"]:
                e = dict(e, pid=pid)
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"{name} (one DBO step, rank 0)"}
                events.append(e)
        path = out_dir / "bench_overlap.trace.json"
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
        files["trace"] = path.name
    for sh in bundle["shapes"]:
        files.update(sh.get("trace_files", {}))
    plot = write_plot(bundle, str(out_dir / "bench_overlap.png"))
    files["plot"] = Path(plot).name if plot else None
    if plot is None:
        bundle["warnings"].append("matplotlib is not importable: no PNG plot")
    files["json"] = "bench_overlap.json"
    (out_dir / "bench_overlap.json").write_text(json.dumps(bundle, indent=1, default=str))


def failed(bundle: dict) -> bool:
    tol = TOLERANCE[DTYPES[bundle["args"]["dtype"]]]
    for sh in bundle["shapes"]:
        if any(not err["token_median"] <= tol for err in sh.get("checks", {}).values()):
            return True
        g = sh.get("cuda_graph") or {}
        if g.get("ok") and not (g["dbo_replay_rel_err"] <= tol and g["serial_replay_rel_err"] <= tol):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend.startswith("deepep"):
        if args.fake_deep_ep:
            from dbo.testing.fake_deep_ep import ensure_fake_deep_ep
            ensure_fake_deep_ep("v1")
        elif args.device == "cpu":
            print("DeepEP backends need --device cuda (or --fake-deep-ep to smoke-test on the CPU)",
                  file=sys.stderr)
            return 2
    deepep_setup = configure_deepep(args)
    rank, world, local_rank = init_distributed(args.device)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    out_dir = Path(args.out)
    finished = False
    try:
        env = collect_env(args, device, world)
        env["deepep_setup"] = deepep_setup
        with torch.inference_mode():
            bundle = run(args, rank, world, device, out_dir, env)
        if rank == 0:
            print(format_table(bundle), flush=True)
        finished = True
        return 1 if failed(bundle) else 0
    finally:
        if args.backend.startswith("deepep"):
            from dbo.backends.deepep_buffer import BUFFER_CACHE
            BUFFER_CACHE.reset()
        shutdown_distributed(wait_for_peers=finished)


if __name__ == "__main__":
    sys.exit(main())
