"""The overlap benchmark's options: one frozen, validated value that the command line builds
(:func:`dbo.bench.overlap.args.parse_args`) and every part of the run reads.

:class:`OverlapOptions` holds what the run was asked for, defaults filled in; a value that no
run could honour (a top-k over more experts than exist, an emulated rank outside its group, an
SM count DeepEP refuses) is a ``ValueError`` naming the option as the command line spells it.
What depends on the machine (a CUDA device, free memory, writable paths, the process group's
size) is checked where the command line is read, not here. ``to_json`` is the bundle's
``args``, with the same keys the command has always written; ``from_json`` reads it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["DTYPES", "TOLERANCE", "MODES", "DEFAULT_MODES", "DEFAULT_BACKEND", "LAYOUTS",
           "OverlapOptions", "portable"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
MODES = ("compute", "dbo_compute", "merged_compute", "comm", "serial", "dbo", "merged", "sbo", "sbo_dbo")
#: what runs unless --modes says otherwise (sbo and sbo+dbo pay in decode only: the decode steps
#: ask for them)
DEFAULT_MODES = MODES[:-2]
#: the backend when --backend is not given, per device (the CPU one must be in cpu_backends())
DEFAULT_BACKEND = {"cuda": "deepep_ht", "cpu": "all2all"}
#: the DeepEP layouts an emulated rank moves its bytes in
LAYOUTS = ("deepep_ll", "deepep_ht")
_LL_ROWS = ("masked", "auto", "full")


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class OverlapOptions:
    """Everything ``python -m dbo.bench overlap`` was asked for, defaults filled in.

    The fields are the command line's options under their ``argparse`` names (``--attn-width``
    is ``attn_width``); sequences are tuples. Besides them:

    * ``backend_kwargs``: the backend constructor's keyword arguments (``--backend-opt``
      parsed, and an emulated rank's group, rank, layout and hosts);
    * ``link_model``: the :class:`~dbo.backends.simulated_link.SimulatedLink` of ``--link``
      (None without it; the bundle records it in ``env.simulated_link``, not in ``args``);
    * :attr:`layout` (derived): the layout the bytes move in.

    Raises:
        ValueError: a value or a combination no run can honour, in one line that names the
            option (``--topk 9: must be <= --experts (8)``).
    """

    backend: str
    link: str | None = None
    link_order: str = "nic"
    remote_fraction: float | None = None
    emulate_ep: int | None = None
    emulate_rank: int = 0
    emulate_layout: str = "deepep_ll"
    gpus_per_host: int = 8
    backend_opt: tuple[str, ...] = ()
    device: str
    dtype: str
    tokens: tuple[int, ...]
    intermediate: tuple[int, ...]
    shared_intermediate: int | None = None
    hidden: int
    experts: int
    topk: int
    attn_width: int
    attn_yield: bool = False
    layers: int
    num_sms: tuple[int, ...] = ()
    ll_rows: str = "masked"
    modes: tuple[str, ...] = DEFAULT_MODES
    steps: int
    warmup: int
    cuda_graph: bool = False
    profile_shape: str = "auto"
    sm_carveout: int | None = None
    sbo_sm_carveout: int | None = None
    sbo_groups: int = 2
    dbo_sm_carveout: tuple[int | None, ...] = (None,)
    dbo_compute_sms: int | None = None
    autotune: bool = True
    quick: bool = False
    fake_deep_ep: bool = False
    time_budget_s: float = 0.0
    save_config: str | None = None
    seed: int = 0
    out: str = "bench_overlap_out"
    backend_kwargs: Mapping[str, object] = field(default_factory=dict)
    link_model: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("backend_opt", "tokens", "intermediate", "num_sms", "modes", "dbo_sm_carveout"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "backend_kwargs", MappingProxyType(dict(self.backend_kwargs)))
        self._check()

    # ---- derived ---------------------------------------------------------------------------

    @property
    def layout(self) -> str:
        """The layout the bytes move in: the backend's, or the DeepEP layout an emulated rank
        moves them in."""
        return self.emulate_layout if self.emulate_ep else self.backend

    @property
    def decode(self) -> bool:
        """Decode steps (a low-latency layout): split decisions are the decode thresholds."""
        from dbo.backends import BACKENDS

        return BACKENDS[self.layout].low_latency

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tolerance(self) -> float:
        """The largest median token relative error an output may have against the serial one."""
        return TOLERANCE[self.torch_dtype]

    def ep_group(self, rank: int, world: int) -> tuple[int, int]:
        """``(rank, size)`` of the expert-parallel group the model is built for: the process
        group's, or the emulated one."""
        return (self.emulate_rank, self.emulate_ep) if self.emulate_ep else (rank, world)

    def config_count(self) -> int:
        """How many configurations the run times (the progress bar's length)."""
        s = max(1, len(self.num_sms))
        per = {"compute": 1, "dbo_compute": 1, "merged_compute": 1, "comm": s, "serial": s,
               "dbo": s * len(self.dbo_sm_carveout), "merged": s * len(self.dbo_sm_carveout),
               "sbo": s, "sbo_dbo": s}
        n = sum(per[m] for m in self.modes) + 1  # +1: traces
        if self.cuda_graph:
            n += 1
        if self.autotune:
            # the untuned wrapper, and the wrapper with the tuned config (the tuning: one more per size)
            n += 2
        tunings = len(self.intermediate) if self.autotune else 0
        return n * len(self.tokens) * len(self.intermediate) + tunings

    def profiled_shape(self) -> tuple[int, int] | None:
        """``(tokens, intermediate)`` of the shape profiled with torch.profiler, None for none."""
        if self.profile_shape == "none":
            return None
        if self.profile_shape == "auto":
            toks = sorted(self.tokens)
            t = toks[-1] if self.decode else toks[len(toks) // 2]
            return t, min(self.intermediate)
        t, i = self.profile_shape.split(":")
        return int(t), int(i)

    def bytes_at_least(self, world: int) -> int:
        """A lower bound of a rank's memory for the largest shape: its tokens in, out and
        dispatched (``topk`` copies), and its share of every layer's expert weights (three
        ``hidden x intermediate`` matrices an expert)."""
        elem = self.torch_dtype.itemsize
        tokens = max(self.tokens) * self.hidden * elem * (2 + self.topk)
        experts = self.experts // (self.emulate_ep or world)
        weights = self.layers * experts * 3 * self.hidden * max(self.intermediate) * elem
        return tokens + weights

    # ---- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The bundle's ``args``: every option (paths made portable), ``backend_kwargs`` and
        ``layout``; not ``link_model`` (the bundle has it in ``env.simulated_link``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "link_model":
                continue
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            elif isinstance(v, str):
                v = portable(v, self.out)
            out[f.name] = v
        out["layout"] = self.layout
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OverlapOptions:
        """The options of a bundle's ``args`` (its ``link_model`` parsed again from ``link``)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"link_model"}
        values = {k: v for k, v in d.items() if k in names}
        if values.get("link") is not None:
            from dbo.backends.simulated_link import SimulatedLink

            share = 1.0 if values.get("remote_fraction") is None or values.get("emulate_ep") \
                else values["remote_fraction"]
            values["link_model"] = SimulatedLink.parse(values["link"], share,
                                                       values.get("link_order", "nic"))
        return cls(**values)

    # ---- validation ------------------------------------------------------------------------

    def _check(self) -> None:
        from dbo.backends import BACKENDS, backend_options, describe_backend

        if self.backend not in BACKENDS:
            listed = ", ".join(describe_backend(n) for n in sorted(BACKENDS))
            raise ValueError(f"--backend {self.backend}: unknown (backends: {listed})")
        for name, value, allowed in (("device", self.device, ("cpu", "cuda")),
                                     ("dtype", self.dtype, tuple(DTYPES)),
                                     ("link_order", self.link_order, ("nic", "host")),
                                     ("emulate_layout", self.emulate_layout, LAYOUTS)):
            if value not in allowed:
                raise ValueError(f"{_flag(name)} {value}: must be one of {', '.join(allowed)}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"--modes {' '.join(self.modes)}: want one or more of {', '.join(MODES)}")
        self._check_emulation()
        options = backend_options(self.backend)
        unknown = [k for k in self.backend_kwargs if options is not None and k not in options]
        if unknown:
            raise ValueError(f"--backend-opt {unknown[0]}: {self.backend} has no such option (its "
                             f"options: {', '.join(options) or 'none'})")
        for low, names in ((1, ("hidden", "experts", "topk", "attn_width", "layers", "steps",
                                "intermediate")), (0, ("warmup",)), (2, ("tokens",))):  # 2: two ubatches
            for name in names:
                value = getattr(self, name)
                for v in value if isinstance(value, tuple) else (value,):
                    if v < low:
                        raise ValueError(f"{_flag(name)} {v}: must be >= {low}")
        if not self.tokens or not self.intermediate:
            raise ValueError("--tokens and --intermediate: want at least one size each")
        odd = [s for s in self.num_sms if s % 2]
        if odd:
            raise ValueError(f"--num-sms {odd[0]}: must be even (DeepEP)")
        if self.topk > self.experts:
            raise ValueError(f"--topk {self.topk}: must be <= --experts ({self.experts})")
        if self.sbo_groups < 1:
            raise ValueError(f"--sbo-groups {self.sbo_groups}: must be >= 1")
        if not self.dbo_sm_carveout:
            raise ValueError("--dbo-sm-carveout: want at least one value (none for no carve-out)")
        if self.save_config and (len(self.intermediate) != 1 or not self.autotune):
            raise ValueError(f"--save-config {self.save_config}: needs one --intermediate and the "
                             "autotune (no --no-autotune)")
        if self.ll_rows not in _LL_ROWS and not self.ll_rows.isdigit():
            raise ValueError(f"--ll-rows {self.ll_rows!r}: must be masked, auto, full or a number")
        if self.profile_shape not in ("auto", "none"):
            t, sep, i = self.profile_shape.partition(":")
            if not (sep and t.isdigit() and i.isdigit()):
                raise ValueError(f"--profile-shape {self.profile_shape!r}: must be "
                                 "TOKENS:INTERMEDIATE, auto or none")

    def _check_emulation(self) -> None:
        from dbo.backends import BACKENDS

        emulated = BACKENDS[self.backend].emulated  # checked by _check
        if self.emulate_ep is None:
            if emulated:
                raise ValueError("--backend emulated: give the group it stands for with --emulate-ep N")
            return
        if not emulated:
            raise ValueError(f"--emulate-ep with --backend {self.backend}: an emulated rank moves its "
                             "bytes in --emulate-layout (deepep_ll or deepep_ht); leave --backend out")
        if self.emulate_ep < 2:
            raise ValueError(f"--emulate-ep {self.emulate_ep}: an expert-parallel group has at least "
                             "2 ranks")
        if not 0 <= self.emulate_rank < self.emulate_ep:
            raise ValueError(f"--emulate-rank {self.emulate_rank}: must be in [0, {self.emulate_ep})")
        if self.gpus_per_host < 1 or (self.emulate_ep > self.gpus_per_host
                                      and self.emulate_ep % self.gpus_per_host):
            raise ValueError(f"--gpus-per-host {self.gpus_per_host}: must be >= 1 and divide "
                             f"--emulate-ep {self.emulate_ep} when the group spans hosts")
        if self.remote_fraction is not None and not 0.0 <= self.remote_fraction <= 1.0:
            raise ValueError(f"--remote-fraction {self.remote_fraction}: want a share in [0, 1]")
        if self.experts % self.emulate_ep:
            fit = max(self.emulate_ep, self.experts // self.emulate_ep * self.emulate_ep)
            raise ValueError(f"--experts {self.experts} is not a multiple of the world size "
                             f"{self.emulate_ep} (each rank holds experts/world of them; e.g. "
                             f"--experts {fit})")
