"""The overlap benchmark's command line: the parser, the defaults per device, and the one place the
parsed line becomes :class:`~dbo.bench.overlap.options.OverlapOptions`; the run's environment
record and DeepEP's set-up before any buffer exists."""

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
from dbo.backends import BACKENDS, describe_backend
from dbo.bench.cli import (
    ArgumentParser,
    add_link_arguments,
    check_backend_fits,
    check_device,
    check_experts_split,
    check_memory_fits,
    check_writable_file,
    check_writable_folder,
    env_world_size,
    parse_link,
)
from dbo.bench.overlap.options import (
    DEFAULT_BACKEND,
    DEFAULT_MODES,
    DTYPES,
    MODES,
    TOLERANCE,
    OverlapOptions,
    portable,
)

__all__ = ["DTYPES", "TOLERANCE", "MODES", "PROG", "DEFAULT_BACKEND", "parse_args",
           "options_from", "defaults", "parse_backend_opts", "portable", "collect_env",
           "configure_deepep"]

PROG = "python -m dbo.bench overlap"


# ---- arguments ------------------------------------------------------------------------------


def _opt_int(v: str) -> int | None:
    if v.lower() == "none":
        return None
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {v}")
    return n


def parse_args(argv: list[str] | None = None) -> OverlapOptions:
    """The options of command line ``argv`` (default ``sys.argv[1:]``); bad input ends the
    program in one line, exit code 2."""
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
    check_device(p, args.device)
    try:
        world = env_world_size()
        opts = options_from(args, world, link=parse_link(p, args))
    except ValueError as exc:
        p.error(str(exc))
    check_backend_fits(p, opts.backend, device=opts.device, dtype=opts.dtype,
                       fake_deep_ep=opts.fake_deep_ep)
    check_experts_split(p, opts.experts, opts.ep_group(0, world)[1])
    check_memory_fits(p, f"--tokens {max(opts.tokens)} (--hidden {opts.hidden}, --intermediate "
                         f"{max(opts.intermediate)}, --topk {opts.topk}, --layers {opts.layers})",
                      opts.bytes_at_least(world), opts.device)
    if opts.save_config:
        check_writable_file(p, "--save-config", opts.save_config)
    check_writable_folder(p, "--out", opts.out)
    return opts


def options_from(args: argparse.Namespace, world: int, link: Any = None) -> OverlapOptions:
    """The one place a parsed command line becomes :class:`OverlapOptions`: ``--backend-opt``
    parsed, an emulated rank's backend and options, the defaults of the device filled in
    (:func:`defaults`). ``world``: the process group's size; ``link``: ``--link``'s
    ``SimulatedLink`` (None without it).

    Raises:
        ValueError: a bad value or combination, in one line naming the option.
    """
    values = dict(vars(args))
    values["backend_kwargs"] = parse_backend_opts(args.backend_opt)
    values["link_model"] = link
    if args.emulate_ep is not None:
        if world != 1:
            raise ValueError(f"--emulate-ep under a group of {world} ranks: run it as plain python "
                             "(one process plays the rank)")
        # a --backend other than emulated is refused by the options, in their words
        values["backend"] = args.backend or "emulated"
        values["backend_kwargs"].update(ep_size=args.emulate_ep, rank=args.emulate_rank,
                                        layout=args.emulate_layout, gpus_per_host=args.gpus_per_host)
        if args.remote_fraction is not None:
            values["backend_kwargs"]["remote_fraction"] = args.remote_fraction
    if values["device"] is None:
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if values["backend"] is None:
        values["backend"] = DEFAULT_BACKEND[values["device"]]
    layout = args.emulate_layout if args.emulate_ep else values["backend"]
    for k, v in defaults(values["device"], layout, quick=args.quick,
                         emulated=args.emulate_ep is not None).items():
        if values.get(k) is None:
            values[k] = v
    if not BACKENDS[layout].sets_num_sms or args.emulate_ep:
        values["num_sms"] = []  # DeepEP's SM count is normal mode's, on a real group
    if values["dbo_sm_carveout"] is None:
        values["dbo_sm_carveout"] = [None]
    return OverlapOptions(**values)


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


def defaults(device: str, layout: str, *, quick: bool, emulated: bool) -> dict[str, Any]:
    """The values of the options left out: tiny shapes on the CPU, DeepSeek-V3 sizes on GPUs
    (``layout``: the layout the bytes move in; ``quick``: a small grid)."""
    cpu = device == "cpu"
    spec = BACKENDS[layout]
    ll, ht = spec.low_latency, spec.sets_num_sms
    if cpu:
        # DeepEP's combine is bf16 only (the --fake-deep-ep runs keep its checks)
        dtype = "bfloat16" if spec.bf16_only else "float32"
        d: dict[str, Any] = dict(dtype=dtype, hidden=128, experts=8, topk=2, attn_width=128, layers=2,
                                 tokens=[64] if quick else [64, 256], intermediate=[64],
                                 steps=3 if quick else 10, warmup=1, time_budget_s=0.0)
    else:
        # decode steps are short: more layers per step (the CUDA graph captures "several")
        d = dict(dtype="bfloat16", hidden=7168, experts=256, topk=8, attn_width=4096,
                 layers=4 if ll else 2, steps=20, warmup=3, time_budget_s=280.0)
        if ll:
            d.update(tokens=[64, 256] if quick else [32, 64, 128, 256, 512], intermediate=[2048])
        else:
            d.update(tokens=[4096] if quick else [1024, 4096, 16384],
                     intermediate=[512] if quick else [2048, 512])
    d["num_sms"] = ([24] if quick else [24, 32, 48]) if ht and not cpu and not emulated else []
    return d


# ---- process group and environment ---------------------------------------------------------


def collect_env(device: torch.device, world: int, *, backend: str, out: str) -> dict[str, Any]:
    """The bundle's ``env``: versions, the device, the relevant environment variables, the
    command line (paths relative to the working directory or the bundle's folder ``out``)."""
    # no hostname, and argv's paths made portable: bundles are shared (docs/results/)
    env: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": [portable(a, out) for a in sys.argv], "python": platform.python_version(),
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
    if BACKENDS[backend].uses_deep_ep:
        from dbo.backends.deepep.buffer import detect_deep_ep_api
        env["deep_ep"] = detect_deep_ep_api().describe()
    for mod in ("matplotlib", "tqdm"):
        try:
            __import__(mod)
            env[mod] = True
        except ImportError:
            env[mod] = False
    return env


def configure_deepep(backend: str, tokens: tuple[int, ...], num_sms: tuple[int, ...]) -> dict[str, Any]:
    """Before any DeepEP buffer exists: size it for the largest of ``num_sms`` (DeepEP normal
    mode's SM counts) and of ``tokens`` (per rank). Returns what it found and changed (for the
    bundle's environment)."""
    found: dict[str, Any] = {}
    spec = BACKENDS[backend]
    if spec.uses_deep_ep and spec.low_latency:
        need = (max(tokens) + 1) * 2
        if int(os.environ.get("NVSHMEM_QP_DEPTH", "1024")) < need:
            # DeepEP asserts NVSHMEM_QP_DEPTH >= (max_tokens_per_rank + 1) * 2 (default 1024)
            os.environ["NVSHMEM_QP_DEPTH"] = str(1 << (need - 1).bit_length())
            found["set_NVSHMEM_QP_DEPTH"] = os.environ["NVSHMEM_QP_DEPTH"]
    if spec.uses_deep_ep and spec.sets_num_sms:
        from dbo.backends.deepep.buffer import detect_deep_ep_api
        api = detect_deep_ep_api()
        found["deep_ep_default_num_sms"] = api.buffer_cls.num_sms
        if num_sms:
            # the normal-mode buffer is sized by Buffer.num_sms when created: size it for the most
            api.buffer_cls.set_num_sms(max(num_sms))
    return found
