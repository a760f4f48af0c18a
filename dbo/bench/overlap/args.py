"""The overlap benchmark's command line, defaults, process group and environment record."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import dbo
from dbo.backends import BACKENDS, backend_options, describe_backend
from dbo.bench.cli import (
    ArgumentParser,
    add_link_arguments,
    check_at_least,
    check_backend_fits,
    check_device,
    check_experts_split,
    check_memory_fits,
    check_writable_file,
    check_writable_folder,
    env_world_size,
    parse_link,
)

__all__ = ["DTYPES", "TOLERANCE", "MODES", "SCHEMA", "PROG", "DEFAULT_BACKEND", "parse_args",
           "resolve_defaults", "portable", "collect_env", "configure_deepep", "count_configs",
           "profile_target"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
MODES = ("compute", "dbo_compute", "merged_compute", "comm", "serial", "dbo", "merged", "sbo", "sbo_dbo")
#: what runs unless --modes says otherwise (sbo and sbo+dbo pay in decode only: the decode steps
#: ask for them)
DEFAULT_MODES = MODES[:-2]
SCHEMA = "dbo.bench_overlap/2"  # 2: one expert implementation (no expert_chunks)
PROG = "python -m dbo.bench overlap"
#: the backend when --backend is not given, per device (the CPU one must be in cpu_backends())
DEFAULT_BACKEND = {"cuda": "deepep_ht", "cpu": "all2all"}


# ---- arguments ------------------------------------------------------------------------------


def _opt_int(v: str) -> int | None:
    if v.lower() == "none":
        return None
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {v}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG,
                       description="How much of the all-to-all dual-batch overlap hides, per MoE "
                                   "layer (run under torchrun)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                   help=f"default {DEFAULT_BACKEND['cuda']} on cuda, {DEFAULT_BACKEND['cpu']} on cpu; "
                        + ", ".join(describe_backend(n) for n in sorted(BACKENDS)
                                    if not BACKENDS[n].run_on_gpus))
    add_link_arguments(p)
    p.add_argument("--emulate-ep", type=int, default=None, metavar="N",
                   help="play one rank of an N-rank expert-parallel group on this one process (the "
                        "emulated backend: DeepEP's layout, the rank's experts and bytes, no peers); "
                        "run as plain python, not torchrun")
    p.add_argument("--emulate-rank", type=int, default=0, help="with --emulate-ep: the rank played")
    p.add_argument("--emulate-layout", choices=["deepep_ll", "deepep_ht"], default="deepep_ll",
                   help="with --emulate-ep: the DeepEP layout the bytes move in (deepep_ll: decode, "
                        "deepep_ht: prefill)")
    p.add_argument("--gpus-per-host", type=int, default=8,
                   help="with --emulate-ep: ranks per host; bytes to other hosts cross --link")
    p.add_argument("--backend-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword argument of the backend's constructor (repeatable), e.g. "
                        "put_order=rank for copy_engine; ints, floats, true/false parsed")
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
                   help="yield inside the attention stand-in too (as examples/moe_overlap.py does)")
    p.add_argument("--layers", type=int, default=None,
                   help="MoE layers per step (deepep_ll 4, else 2); times are reported per layer")
    p.add_argument("--num-sms", type=int, nargs="+", default=None,
                   help="deepep_ht: SMs for DeepEP's kernels, Buffer.set_num_sms (24 32 48)")
    p.add_argument("--ll-rows", default="masked",
                   help="deepep_ll experts: masked (the fused kernels over the rows that arrived, "
                        "counted on the device), or two batched matmuls over auto (the most "
                        "tokens any expert received, rounded up to 16), full (the whole "
                        "capacity) or a number of rows per expert")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                   help=f"what to measure (default: {' '.join(DEFAULT_MODES)})")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (20)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (3)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="deepep_ll, copy_engine: capture a whole serial and DBO step into CUDA graphs "
                        "and replay")
    p.add_argument("--profile-shape", default="auto",
                   help="TOKENS:INTERMEDIATE whose best serial and DBO steps are profiled with "
                        "torch.profiler, 'auto' or 'none'")
    p.add_argument("--sm-carveout", type=int, default=None,
                   help="torch._C._set_sm_carveout_experimental(N) for every run (experiment)")
    p.add_argument("--sbo-sm-carveout", type=int, default=None,
                   help="the sbo and sbo_dbo modes: SMs the experts leave free while a group's "
                        "combine runs (MoEKernel.sbo_sm_carveout)")
    p.add_argument("--sbo-groups", type=int, default=2,
                   help="the sbo and sbo_dbo modes: groups of local experts, each with its own "
                        "combine (MoEKernel.sbo_groups; default 2)")
    p.add_argument("--dbo-sm-carveout", type=_opt_int, nargs="+", default=None,
                   help="SM carve-outs tried for the DBO runs only (overlapped_forward's "
                        "sm_carveout: matmuls and grouped GEMMs leave N SMs to DeepEP), e.g. "
                        "'none 24 48' (default: none)")
    p.add_argument("--dbo-compute-sms", type=int, default=None,
                   help="run the DBO (and tuned wrapper) steps' compute on a CUDA green context of "
                        "N SMs (overlapped_forward's compute_sms), leaving the rest to the "
                        "communication kernels (default: all SMs)")
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
    p.add_argument("--save-config", default=None, metavar="PATH",
                   help="write the autotune's choice (thresholds, schedule, sbo groups, carve-out) and "
                        "the deployment it was tuned for to PATH (JSON; DBOWrapper(model, "
                        "dbo.deployment.load_deployment_config(PATH))); one --intermediate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_overlap_out", help="directory of the bundle")
    args = p.parse_args(argv)
    try:
        args.backend_kwargs = parse_backend_opts(args.backend_opt)
        args.link_model = parse_link(p, args)
        world = env_world_size()
    except ValueError as exc:
        p.error(str(exc))
    emulate(p, args, world)
    check_device(p, args.device)
    resolve_defaults(args)
    check_backend_fits(p, args.backend, device=args.device, dtype=args.dtype,
                       fake_deep_ep=args.fake_deep_ep)
    options = backend_options(args.backend)
    unknown = [k for k in args.backend_kwargs if options is not None and k not in options]
    if unknown:
        p.error(f"--backend-opt {unknown[0]}: {args.backend} has no such option (its options: "
                f"{', '.join(options) or 'none'})")
    check_at_least(p, args, 1, "hidden", "experts", "topk", "attn_width", "layers", "steps",
                   "intermediate")
    check_at_least(p, args, 0, "warmup")
    check_at_least(p, args, 2, "tokens")  # two ubatches
    odd = [s for s in args.num_sms if s % 2]
    if odd:
        p.error(f"--num-sms {odd[0]}: must be even (DeepEP)")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk}: must be <= --experts ({args.experts})")
    if args.sbo_groups < 1:
        p.error(f"--sbo-groups {args.sbo_groups}: must be >= 1")
    check_experts_split(p, args.experts, args.emulate_ep or world)
    check_memory_fits(p, f"--tokens {max(args.tokens)} (--hidden {args.hidden}, --intermediate "
                         f"{max(args.intermediate)}, --topk {args.topk}, --layers {args.layers})",
                      overlap_bytes_at_least(args, world), args.device)
    if args.save_config:
        if len(args.intermediate) != 1 or not args.autotune:
            p.error(f"--save-config {args.save_config}: needs one --intermediate and the autotune "
                    "(no --no-autotune)")
        check_writable_file(p, "--save-config", args.save_config)
    check_writable_folder(p, "--out", args.out)
    if args.ll_rows not in ("masked", "auto", "full") and not args.ll_rows.isdigit():
        p.error(f"--ll-rows {args.ll_rows!r}: must be masked, auto, full or a number")
    if args.profile_shape not in ("auto", "none"):
        t, sep, i = args.profile_shape.partition(":")
        if not (sep and t.isdigit() and i.isdigit()):
            p.error(f"--profile-shape {args.profile_shape!r}: must be TOKENS:INTERMEDIATE, auto "
                    "or none")
    return args


def overlap_bytes_at_least(args: argparse.Namespace, world: int) -> int:
    """A lower bound of a rank's memory for the largest shape: its tokens in, out and dispatched
    (``topk`` copies), and its share of every layer's expert weights (three ``hidden x
    intermediate`` matrices an expert)."""
    elem = DTYPES[args.dtype].itemsize
    tokens = max(args.tokens) * args.hidden * elem * (2 + args.topk)
    experts = args.experts // (args.emulate_ep or world)
    weights = args.layers * experts * 3 * args.hidden * max(args.intermediate) * elem
    return tokens + weights


def parse_backend_opts(opts: list[str]) -> dict[str, object]:
    """``["put_order=rank", "num_sms=24"]`` -> ``{"put_order": "rank", "num_sms": 24}``."""
    out: dict[str, object] = {}
    for opt in opts:
        key, sep, raw = opt.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--backend-opt wants KEY=VALUE with KEY a Python name, got {opt!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def emulate(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """``--emulate-ep N``: the emulated backend as rank ``--emulate-rank`` of N (checked here, in one
    line each); its options join ``args.backend_kwargs``."""
    if args.emulate_ep is None:
        if args.backend == "emulated":
            p.error("--backend emulated: give the group it stands for with --emulate-ep N")
        return
    if args.backend not in (None, "emulated"):
        p.error(f"--emulate-ep with --backend {args.backend}: an emulated rank moves its bytes in "
                "--emulate-layout (deepep_ll or deepep_ht); leave --backend out")
    if world != 1:
        p.error(f"--emulate-ep under a group of {world} ranks: run it as plain python (one process "
                "plays the rank)")
    if args.emulate_ep < 2:
        p.error(f"--emulate-ep {args.emulate_ep}: an expert-parallel group has at least 2 ranks")
    if not 0 <= args.emulate_rank < args.emulate_ep:
        p.error(f"--emulate-rank {args.emulate_rank}: must be in [0, {args.emulate_ep})")
    if args.gpus_per_host < 1 or (args.emulate_ep > args.gpus_per_host
                                  and args.emulate_ep % args.gpus_per_host):
        p.error(f"--gpus-per-host {args.gpus_per_host}: must be >= 1 and divide --emulate-ep "
                f"{args.emulate_ep} when the group spans hosts")
    if args.remote_fraction is not None and not 0.0 <= args.remote_fraction <= 1.0:
        p.error(f"--remote-fraction {args.remote_fraction}: want a share in [0, 1]")
    args.backend = "emulated"
    args.backend_kwargs.update(ep_size=args.emulate_ep, rank=args.emulate_rank, layout=args.emulate_layout,
                               gpus_per_host=args.gpus_per_host)
    if args.remote_fraction is not None:
        args.backend_kwargs["remote_fraction"] = args.remote_fraction


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the arguments left at None: tiny shapes on the CPU, DeepSeek-V3 sizes on GPUs."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = DEFAULT_BACKEND[args.device]
    # the layout the bytes move in: the backend's, or the one an emulated rank moves them in
    args.layout = args.emulate_layout if args.emulate_ep else args.backend
    cpu, quick = args.device == "cpu", args.quick
    ll, ht = args.layout == "deepep_ll", args.layout == "deepep_ht"
    if cpu:
        # DeepEP's combine is bf16 only (the --fake-deep-ep runs keep its checks)
        dtype = "bfloat16" if args.layout.startswith("deepep") else "float32"
        d = dict(dtype=dtype, hidden=128, experts=8, topk=2, attn_width=128, layers=2,
                 tokens=[64] if quick else [64, 256], intermediate=[64],
                 steps=3 if quick else 10, warmup=1, time_budget_s=0.0)
    else:
        # decode steps are short: more layers per step (the CUDA graph captures "several")
        d = dict(dtype="bfloat16", hidden=7168, experts=256, topk=8, attn_width=4096,
                 layers=4 if ll else 2,
                 steps=20, warmup=3, time_budget_s=280.0)
        if ll:
            d.update(tokens=[64, 256] if quick else [32, 64, 128, 256, 512], intermediate=[2048])
        else:
            d.update(tokens=[4096] if quick else [1024, 4096, 16384],
                     intermediate=[512] if quick else [2048, 512])
    d["num_sms"] = ([24] if quick else [24, 32, 48]) if ht and not cpu and not args.emulate_ep else []
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if not ht or args.emulate_ep:
        args.num_sms = []
    if args.dbo_sm_carveout is None:
        args.dbo_sm_carveout = [None]


# ---- process group and environment ---------------------------------------------------------


def portable(arg: str, out: str) -> str:
    """``arg`` (a value, or ``--flag=value``) with an absolute path written relative to the
    working directory or the output folder ``out``, else by its last part: bundles are shared
    (docs/results/) and name no machine's paths."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    path = Path(value)
    if not path.is_absolute():
        return arg
    bases = (Path.cwd(), Path(out).resolve())
    base = next((b for b in bases if path.is_relative_to(b)), None)
    return flag + eq + (str(path.relative_to(base)) if base else path.name)


def collect_env(args: argparse.Namespace, device: torch.device, world: int) -> dict[str, Any]:
    # no hostname, and argv's paths made portable: bundles are shared (docs/results/)
    env: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": [portable(a, args.out) for a in sys.argv], "python": platform.python_version(),
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
        from dbo.backends.deepep.buffer import detect_deep_ep_api
        env["deep_ep"] = detect_deep_ep_api().describe()
    for mod in ("matplotlib", "tqdm"):
        try:
            __import__(mod)
            env[mod] = True
        except ImportError:
            env[mod] = False
    return env


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
        from dbo.backends.deepep.buffer import detect_deep_ep_api
        api = detect_deep_ep_api()
        found["deep_ep_default_num_sms"] = api.buffer_cls.num_sms
        if args.num_sms:
            # the normal-mode buffer is sized by Buffer.num_sms when created: size it for the most
            api.buffer_cls.set_num_sms(max(args.num_sms))
    return found


def count_configs(args: argparse.Namespace) -> int:
    s = max(1, len(args.num_sms))
    per = {"compute": 1, "dbo_compute": 1, "merged_compute": 1, "comm": s, "serial": s,
           "dbo": s * len(args.dbo_sm_carveout), "merged": s * len(args.dbo_sm_carveout), "sbo": s,
           "sbo_dbo": s}
    n = sum(per[m] for m in args.modes) + 1  # +1: traces
    if args.cuda_graph:
        n += 1
    if args.autotune:
        # the untuned wrapper, and the wrapper with the tuned config (the tuning: one more per size)
        n += 2
    return n * len(args.tokens) * len(args.intermediate) + (len(args.intermediate) if args.autotune else 0)


def profile_target(args: argparse.Namespace) -> tuple[int, int] | None:
    if args.profile_shape == "none":
        return None
    if args.profile_shape == "auto":
        toks = sorted(args.tokens)
        t = toks[-1] if args.layout == "deepep_ll" else toks[len(toks) // 2]
        return t, min(args.intermediate)
    t, i = args.profile_shape.split(":")
    return int(t), int(i)
