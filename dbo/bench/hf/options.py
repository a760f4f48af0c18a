"""What the transformers benchmarks are asked for, as frozen, validated values: the model and
where it runs (:class:`ModelOptions`, shared by ``hf-prefill`` and ``hf-generate``), and each
command's own options (:class:`PrefillOptions`, :class:`GenerateOptions`, :class:`LoadOptions`
for ``hf-load``).

The command lines build them (:func:`dbo.bench.hf.args.model_options`, and each command's
``parse_args``); a value no run could honour is a ``ValueError`` in one line naming the option.
What depends on the machine or the files (a CUDA device, the checkpoint's config, the process
group's size, free memory, writable paths) is checked where the command line is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.backends.emulated import EmulatedGroup

__all__ = ["DTYPES", "ModelOptions", "PrefillOptions", "GenerateOptions", "LoadOptions", "EXPERT_SCHEDULES",
           "EP_EXPERTS", "GENERATE_MODES", "EMULATED_BACKEND", "describe_emulated"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: hf-prefill's DBO expert schedules, a row each
EXPERT_SCHEDULES = ("split", "merged", "auto")
#: the experts that run on what arrives, in a loaded model
EP_EXPERTS = ("auto", "library", "model")
#: hf-generate's rows: option -> (row name, prefill overlapped, every decode step overlapped,
#: decode from a CUDA graph)
GENERATE_MODES = {"plain": ("plain", False, False, False), "dbo-prefill": ("DBO prefill", True, False, False),
                  "dbo": ("DBO", True, True, False), "graph": ("plain, graph decode", False, False, True),
                  "dbo-prefill-graph": ("DBO prefill, graph decode", True, False, True),
                  "dbo-graph": ("DBO, graph decode", True, True, True)}


#: the one backend pair of an emulated rank: DeepEP's high-throughput layout for the prompt, its
#: low-latency one inside the decode steps (as the deepep_ht/deepep_ll pair on real ranks)
EMULATED_BACKEND = "emulated"


def describe_emulated(record: dict[str, Any], device: str) -> str:
    """What a table says of an emulated rank (``record``: :meth:`ModelOptions.emulation_record`)
    played on ``device`` (a device name): its group, its share of bytes crossing the link, and
    what the emulation leaves out."""
    n, per_host, share = record["ep_size"], record["gpus_per_host"], record["remote_fraction"]
    crossing = (f"{share:.3f} of the bytes to other ranks cross the link" if share is not None
                else f"{1 - min(per_host, n) / n:.3f} of its bytes leave the host")
    return (f"one {device} as the emulated rank {record['rank']} of EP{n} ({per_host} GPUs a host: "
            f"{crossing}; its own tokens stand in for its peers'; not modelled: incast and congestion "
            "across ranks, stragglers, routing skew, the SMs of DeepEP's RDMA proxies)")


def _check_emulated_backends(names: Any) -> None:
    other = [n for n in names if n != EMULATED_BACKEND]
    if other:
        raise ValueError(f"--backend {other[0]} with --emulate-ep: an emulated rank runs the emulated "
                         "backend (DeepEP's high-throughput layout for the prefill, its low-latency one "
                         "for decode); leave --backend out")


def _at_least(low: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= {low}")


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The model and where it runs: ``--device --preset --layers --dtype --checkpoint
    --save-checkpoint --link --link-order --remote-fraction --seed --json``, defaults filled in.

    ``dtype`` is a torch dtype; ``checkpoint`` is the directory loaded (``--save-checkpoint``'s
    where given: it writes the checkpoint it then loads); ``config`` is the model's transformers
    config (the preset's, or the checkpoint's); ``link_model`` the ``SimulatedLink`` of
    ``--link`` (its text is ``link``). ``emulate_ep`` (``--emulate-ep``): this one process plays
    rank ``emulate_rank`` of a group of that many ranks, ``gpus_per_host`` a host
    (:attr:`emulated`), with the model built holding that rank's experts.

    Raises:
        ValueError: a bad value, in one line naming the option.
    """

    device: str
    preset: str
    layers: int | None = None
    dtype: torch.dtype
    checkpoint: str | None = None
    save_checkpoint: str | None = None
    link: str | None = None
    link_order: str = "nic"
    remote_fraction: float | None = None
    seed: int = 0
    json: str | None = None
    emulate_ep: int | None = None
    emulate_rank: int = 0
    gpus_per_host: int = 8
    config: Any = field(default=None, compare=False, repr=False)
    link_model: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device}: must be cpu or cuda")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"--dtype {self.dtype}: must be one of {', '.join(DTYPES)}")
        _at_least(1, layers=self.layers)
        if self.remote_fraction is not None and not 0.0 < self.remote_fraction <= 1.0:
            raise ValueError(f"--remote-fraction {self.remote_fraction}: want a share in (0, 1]")
        if self.save_checkpoint and self.checkpoint != self.save_checkpoint:
            raise ValueError(f"--checkpoint {self.checkpoint} and --save-checkpoint {self.save_checkpoint}: "
                             "give one (--save-checkpoint writes the checkpoint it then loads)")
        if self.emulate_ep is not None:
            self._check_emulation()

    def _check_emulation(self) -> None:
        n, rank, per_host = self.emulate_ep, self.emulate_rank, self.gpus_per_host
        if n < 2:
            raise ValueError(f"--emulate-ep {n}: an expert-parallel group has at least 2 ranks")
        if not 0 <= rank < n:
            raise ValueError(f"--emulate-rank {rank}: must be in [0, {n})")
        if per_host < 1 or (n > per_host and n % per_host):
            raise ValueError(f"--gpus-per-host {per_host}: must be >= 1 and divide --emulate-ep {n} when "
                             "the group spans hosts")
        if self.checkpoint:
            given = "--save-checkpoint" if self.save_checkpoint else "--checkpoint"
            raise ValueError(f"{given} with --emulate-ep {n}: an emulated rank builds --preset with random "
                             "weights, holding its own experts; it loads no checkpoint (leave the option "
                             "out)")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"--dtype {self.dtype_name} with --emulate-ep {n}: an emulated rank moves "
                             "bfloat16 in DeepEP's layouts (leave --dtype out)")

    @property
    def emulated(self) -> EmulatedGroup | None:
        """The group this process plays one rank of (``--emulate-ep``), None without it."""
        if self.emulate_ep is None:
            return None
        return EmulatedGroup(self.emulate_ep, self.emulate_rank, self.gpus_per_host)

    def emulated_backend_kwargs(self, layout: str, max_tokens_per_rank: int, *,
                                link: bool = True) -> dict[str, Any]:
        """The emulated backend's options: ``layout`` (``deepep_ht``, ``deepep_ll``),
        ``max_tokens_per_rank``, ``--link`` (unless ``link`` is False: the rank's own work with
        no link waits) and ``--remote-fraction`` (the share of the bytes to every other rank
        that crosses the link, in place of counting it from the hosts). The group (size, rank,
        hosts) is the model's."""
        out: dict[str, Any] = {"layout": layout, "max_tokens_per_rank": max_tokens_per_rank}
        if link and self.link_model is not None:
            out["link"] = self.link_model
        if self.remote_fraction is not None:
            out["remote_fraction"] = self.remote_fraction
        return out

    def emulation_record(self) -> dict[str, Any] | None:
        """The emulated group as the JSON files record it (None without ``--emulate-ep``)."""
        if self.emulate_ep is None:
            return None
        return {"ep_size": self.emulate_ep, "rank": self.emulate_rank, "gpus_per_host": self.gpus_per_host,
                "remote_fraction": self.remote_fraction, "link": self.link}

    @property
    def dtype_name(self) -> str:
        """``"float32"`` or ``"bfloat16"``."""
        return str(self.dtype).removeprefix("torch.")

    def written_to(self, directory: str, *, write: bool) -> ModelOptions:
        """These options with the model's checkpoint at ``directory``, written there first
        where ``write``."""
        return dataclasses.replace(self, checkpoint=directory, save_checkpoint=directory if write else None)


@dataclass(frozen=True, kw_only=True)
class PrefillOptions:
    """``hf-prefill``'s options (see its module): the ``backends`` timed, the ``shapes``
    (batch, seq) per rank, the DBO ``expert_schedules`` (a row each), ``ep_experts`` (with a
    checkpoint: the experts choices timed; None: the default, ``auto``), and the rest under
    their options' names.

    Raises:
        ValueError: a bad value or combination, in one line naming the option.
    """

    model: ModelOptions
    backends: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    steps: int = 5
    warmup: int = 2
    logits_to_keep: int = 1
    unconverted: bool = False
    sm_carveout: int | None = None
    tune_sm_carveout: tuple[int | None, ...] | None = None
    expert_schedules: tuple[str, ...] = ("split",)
    max_tokens_per_rank: int | None = None
    profile: str | None = None
    find_syncs: bool = False
    hf_all_to_all: bool = False
    ep_experts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        object.__setattr__(self, "expert_schedules", tuple(self.expert_schedules))
        for name in ("tune_sm_carveout", "ep_experts"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _at_least(1, steps=self.steps, max_tokens_per_rank=self.max_tokens_per_rank)
        _at_least(0, warmup=self.warmup, logits_to_keep=self.logits_to_keep, sm_carveout=self.sm_carveout)
        if not self.backends:
            raise ValueError("--backend: want at least one backend")
        bad = [f"{b}x{s}" for b, s in self.shapes if b < 1 or s < 1]
        if bad or not self.shapes:
            raise ValueError(f"--shape {' '.join(bad)}: want BATCHxSEQ with both >= 1, e.g. 8x2048")
        unknown = [s for s in self.expert_schedules if s not in EXPERT_SCHEDULES]
        if unknown or not self.expert_schedules:
            raise ValueError(f"--expert-schedule {' '.join(self.expert_schedules)}: want one or more of "
                             f"{', '.join(EXPERT_SCHEDULES)}")
        if self.tune_sm_carveout is not None and "auto" not in self.expert_schedules:
            raise ValueError(f"--tune-sm-carveout {list(self.tune_sm_carveout)}: goes with "
                             "--expert-schedule auto")
        if self.ep_experts is not None and any(e not in EP_EXPERTS for e in self.ep_experts):
            raise ValueError(f"--ep-experts {' '.join(self.ep_experts)}: want one or more of "
                             f"{', '.join(EP_EXPERTS)}")
        if self.model.emulate_ep is not None:
            _check_emulated_backends(self.backends)
            if self.unconverted:
                raise ValueError(f"--unconverted with --emulate-ep {self.model.emulate_ep}: an emulated "
                                 "rank's model holds its own experts only, and its tokens stand in for its "
                                 "peers'; there is no original model to compare it with (leave it out)")
        if not self.model.checkpoint:
            for flag, given in (("--hf-all-to-all", self.hf_all_to_all), ("--ep-experts", self.ep_experts)):
                if given:
                    raise ValueError(f"{flag}: needs a loaded model; give --checkpoint DIR or "
                                     "--save-checkpoint DIR")

    @property
    def experts_choices(self) -> tuple[str | None, ...]:
        """The experts choices timed: ``ep_experts`` (``auto`` by default) on a loaded model;
        ``(None,)`` on a built one (its experts are the library's)."""
        if not self.model.checkpoint:
            return (None,)
        return self.ep_experts or ("auto",)

    @property
    def largest_batch_tokens(self) -> int:
        """The most tokens per rank of any shape (what the backends are sized for by default)."""
        return max(b * s for b, s in self.shapes)


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """``hf-generate``'s options (see its module): backend ``pairs`` (prefill backend, decode
    backend or None for the same), ``batch`` sequences of ``prompt`` tokens per rank decoded
    for ``new_tokens`` steps, the dbo rows' ``modes`` (:data:`GENERATE_MODES`), ``static``
    (also transformers' static-cache ``generate()``), ``sm_carveout`` (the overlapped steps')
    and ``temporary_checkpoint`` (the model is
    written to a temporary directory for this run only, removed at the end).

    Raises:
        ValueError: a bad value or combination, in one line naming the option.
    """

    model: ModelOptions
    pairs: list[tuple[str, str | None]]
    batch: int
    prompt: int
    new_tokens: int
    steps: int = 3
    warmup: int = 1
    modes: list[str] = field(default_factory=lambda: ["plain", "dbo-prefill", "dbo"])
    static: bool = True
    temporary_checkpoint: bool = False
    sm_carveout: int | None = None

    def __post_init__(self) -> None:
        _at_least(1, batch=self.batch, prompt=self.prompt, new_tokens=self.new_tokens, steps=self.steps)
        _at_least(0, warmup=self.warmup, sm_carveout=self.sm_carveout)
        unknown = [m for m in self.modes if m not in GENERATE_MODES]
        if unknown:
            raise ValueError(f"--modes {' '.join(self.modes)}: want one or more of "
                             f"{', '.join(GENERATE_MODES)}")
        if "plain" not in self.modes:
            raise ValueError("--modes: give plain too (every DBO row's tokens are checked against it)")
        if not self.pairs:
            raise ValueError("--backend: want at least one backend")
        if self.model.emulate_ep is not None:
            _check_emulated_backends([name for pair in self.pairs for name in pair if name])
        if self.temporary_checkpoint and self.model.device == "cuda":
            raise ValueError("--device cuda: give --checkpoint DIR (or --save-checkpoint DIR to write one)")

    def with_model(self, model: ModelOptions) -> GenerateOptions:
        return dataclasses.replace(self, model=model)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """``hf-load``'s options (see its module): the checkpoint ``dir`` (``preset`` with ``layers``
    decoder layers written there where it has none), ``ranks`` processes per mode, the ``ep``
    mode's ``backend``, a prefill of ``batch`` x ``seq`` tokens per rank, ``check`` (compare the
    DBO logits with the plain model's), and ``config`` (the checkpoint's or the preset's). A
    launched rank has ``worker`` set, its ``mode`` (``plain`` or ``ep``) and ``out`` (where rank 0
    writes the rows).

    Raises:
        ValueError: a bad value or combination, in one line naming the option.
    """

    dir: str
    preset: str = "qwen3-30b-a3b"
    layers: int = 2
    ranks: int = 2
    backend: str = "all2all"
    batch: int = 2
    seq: int = 16
    check: bool = False
    seed: int = 0
    json: str | None = None
    worker: bool = False
    mode: str | None = None
    out: str | None = None
    config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        from dbo.backends import cpu_backends

        _at_least(1, layers=self.layers, ranks=self.ranks, batch=self.batch, seq=self.seq)
        if self.backend not in cpu_backends():
            raise ValueError(f"--backend {self.backend}: hf-load runs on CPU, where these run: "
                             f"{' '.join(cpu_backends())}")
        if self.worker and (self.mode not in ("plain", "ep") or not self.out):
            raise ValueError(f"--worker: wants --mode plain or ep (got {self.mode}) and --out")
