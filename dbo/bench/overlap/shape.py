"""One shape of the overlap benchmark: every measurement of (tokens, intermediate) on a model.

For each shape: the serial and DBO references and their agreement, compute alone (the
communication replaced by a replay of what the backend delivered), communication alone (no
experts), serial and DBO for each DeepEP SM count and DBO SM carve-out, and the wrapper with a
tuned config. The CUDA-graph and trace captures are in :mod:`dbo.bench.overlap.capture`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo.backends.fp8 import FP8_DISPATCH_BYTES
from dbo.bench.overlap.link import COMM_BYTES_BACKENDS, LinkLimits, comm_bytes
from dbo.bench.overlap.model import (
    BenchModel,
    IdentityExperts,
    RecordingPrepareAndFinalize,
    ReplayPrepareAndFinalize,
)
from dbo.bench.overlap.options import OverlapOptions
from dbo.bench.overlap.record import Check, Measurement, ShapeRecord
from dbo.bench.overlap.summary import best_measurement
from dbo.bench.timing import Progress, measure
from dbo.expert_schedule import ExpertSchedule, current_expert_schedule, use_expert_schedule
from dbo.experts import SwiGLUExperts, relative_error
from dbo.moe import MoEKernel
from dbo.overlap import overlapped_forward
from dbo.peers.collectives import all_reduce_max
from dbo.split import SplitConfig, plan_ubatches

__all__ = ["Budget", "compare", "max_rel_error", "SMs", "ShapeBench"]


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
            self.hit = all_reduce_max([time.perf_counter() - self.t0])[0] > self.seconds
        return self.hit


def compare(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> Check:
    """``out`` ``[M, hidden]`` against ``ref`` (same shape): ``rel`` = ||out - ref|| / ||ref||;
    ``token_median``: the median over tokens of each token's relative error (MAX over ranks).
    In bf16 a one-ulp difference between a ubatch's and the whole batch's matmuls can flip a
    near-tie in a later layer's top-k routing and change that token's output entirely; the
    median ignores those few tokens, not a broken step (which breaks most of them)."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    tok = torch.linalg.vector_norm(o - r, dim=-1) / torch.linalg.vector_norm(r, dim=-1).clamp_min(1e-30)
    med = tok.median().item() if tok.numel() else 0.0
    if not torch.isfinite(o).all():
        med = float("inf")
    rel, med = all_reduce_max([relative_error(out, ref), med])
    return Check(rel, med)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> float:
    return all_reduce_max([relative_error(out, ref)])[0]


def _rows_key(mode: str) -> str:
    # sbo+dbo's ubatches dispatch as the split ones do
    return ("merged" if mode.startswith("merged") else "dbo" if mode.startswith(("dbo", "sbo_dbo"))
            else "serial")


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


# ---- one shape ------------------------------------------------------------------------------


class ShapeBench:
    """Every measurement of one (tokens, intermediate) shape on an existing model, into
    :attr:`rec` (a :class:`~dbo.bench.overlap.record.ShapeRecord`)."""

    def __init__(self, opts: OverlapOptions, model: BenchModel, backend: Any, tokens: int,
                 device: torch.device, rank: int, progress: Progress, budget: Budget,
                 dbo_backend: Any = None):
        self.opts, self.model, self.pf, self.T = opts, model, backend, tokens
        #: the backend of the DBO runs: deepep_ll's is sized for one ubatch (its capacity is the
        #: most tokens one dispatch sends), as an engine running DBO would size it
        self.pf_dbo = backend if dbo_backend is None else dbo_backend
        self.device, self.rank, self.progress, self.budget = device, rank, progress, budget
        self.layers = model.dims.layers
        self.tol = opts.tolerance
        self.sms = SMs(backend)
        self.rec = ShapeRecord(backend=opts.backend, tokens=tokens, intermediate=model.dims.intermediate,
                               shared_intermediate=model.dims.shared_intermediate, layers=self.layers)
        g = torch.Generator(device=device).manual_seed(opts.seed * 7919 + rank + 1)
        self.x = torch.randn(tokens, model.dims.hidden, generator=g, device=device,
                             dtype=torch.float32).to(model.dims.dtype)
        self.plan = plan_ubatches(tokens, SplitConfig(num_ubatches=2, decode_token_threshold=1,
                                                      prefill_token_threshold=1))
        #: the same cut with the merged expert schedule (one experts call per layer)
        self.plan_merged = dataclasses.replace(self.plan, expert_schedule=ExpertSchedule.MERGED)
        #: the same cut with each ubatch laid out as sbo (combines per expert group)
        self.plan_sbo_dbo = dataclasses.replace(self.plan, expert_schedule=ExpertSchedule.SBO_DBO)
        #: the library's experts; on deepep_ll with the row bound of each mode (see reference());
        #: their persistent grids leave --sm-carveout SMs free, as cuBLAS does
        self.experts = SwiGLUExperts(sm_carveout=opts.sm_carveout)
        self.rows: dict[str, int | None] = {"serial": None, "dbo": None, "merged": None}
        self.carveout: int | None = None  #: the DBO runs' sm_carveout
        self.batched = backend.activation_format.name == "BATCHED_EXPERTS"
        #: the run's link rate (dbo.bench.overlap.link), set by the caller
        self.link: LinkLimits | None = None
        #: "compute" and "comm" alone, as steps a CUDA graph can hold: each entry readies the
        #: backend and returns the step (set by compute_alone and comm_alone)
        self.alone: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {}

    # -- steps --

    def serial(self) -> torch.Tensor:
        return self.model(self.x)

    def dbo(self, trace: dbo.Trace | None = None) -> torch.Tensor:
        return overlapped_forward(self.model, self.x, plan=self.plan, trace=trace,
                                  sm_carveout=self.carveout, compute_sms=self.opts.dbo_compute_sms)

    def merged(self, trace: dbo.Trace | None = None) -> torch.Tensor:
        """The DBO step with the merged expert schedule."""
        return overlapped_forward(self.model, self.x, plan=self.plan_merged, trace=trace,
                                  sm_carveout=self.carveout, compute_sms=self.opts.dbo_compute_sms)

    def sbo(self) -> torch.Tensor:
        """The unsplit step with the ``sbo`` expert schedule (single-batch overlap)."""
        self._group_options()
        with use_expert_schedule(ExpertSchedule.SBO):
            return self.model(self.x)

    def sbo_dbo(self, trace: dbo.Trace | None = None) -> torch.Tensor:
        """The DBO step with the ``sbo+dbo`` expert schedule (each ubatch laid out as sbo)."""
        self._group_options()
        return overlapped_forward(self.model, self.x, plan=self.plan_sbo_dbo, trace=trace,
                                  sm_carveout=self.carveout, compute_sms=self.opts.dbo_compute_sms)

    def _group_options(self) -> None:
        # the grouped schedules' settings, on whichever kernels the step runs
        for kernel in self.model.kernels:
            kernel.sbo_sm_carveout = self.opts.sbo_sm_carveout
            kernel.sbo_groups = self.opts.sbo_groups

    def use(self, backend: Any, mode: str) -> None:
        if mode.startswith(("dbo", "merged", "sbo_dbo")) and backend is self.pf:
            backend = self.pf_dbo
        self.model.use(backend, self.experts)
        self.experts.batched_rows = self.rows[_rows_key(mode)]

    def label(self, mode: str, sms: int | None = None, carveout: int | None = None) -> str:
        s = f"T={self.T} I={self.model.dims.intermediate} {mode}"
        if sms is not None:
            s += f" s{sms}"
        if carveout is not None:
            s += f" k{carveout}"
        return s

    def run_config(self, mode: str, sms: int | None, step: Callable[[], Any],
                   check: Callable[[torch.Tensor], None] | None = None,
                   carveout: int | None = None) -> Measurement | None:
        if self.budget.expired():
            self.rec.measurements.append(Measurement(mode, sms, carveout, skipped="time budget"))
            self.progress.update(self.label(mode, sms, carveout) + " (skipped)")
            return None
        if check is not None:
            check(step())
        timing = measure(step, warmup=self.opts.warmup, steps=self.opts.steps, device=self.device)
        entry = Measurement(mode, sms, carveout, timing)
        self.rec.measurements.append(entry)
        self.progress.update(self.label(mode, sms, carveout))
        return entry

    def check_against(self, ref: torch.Tensor, name: str) -> Callable[[torch.Tensor], None]:
        def check(out: torch.Tensor) -> None:
            err = compare(out, ref, self.device)
            self.rec.checks[name] = err
            if not err.ok(self.tol):
                self.rec.warnings.append(
                    f"{self.rec.label}: {name} differs from the serial output (median token rel "
                    f"err {err.token_median:.3e} > {self.tol:g}; overall {err.rel:.3e})")
        return check

    # -- phases --

    def _rows_received(self, pf: Any, fn: Callable[[], Any], mode: str) -> int:
        """deepep_ll: the most tokens any local expert received in one step of ``mode``, over
        the ranks (read from what the backend delivered)."""
        recorder = RecordingPrepareAndFinalize(pf)
        self.use(recorder, mode)
        self.experts.batched_rows = None
        recorder.begin_step()
        fn()
        counts: dict[int, torch.Tensor] = {}  # per layer; the merged call sums the ubatches'
        for (ub, layer), r in recorder.records.items():
            if r.expert_tokens_meta is not None:
                c = r.expert_tokens_meta.expert_num_tokens.to(torch.int64)
                key = layer if mode.startswith("merged") else (ub, layer)
                counts[key] = counts[key] + c if key in counts else c
        seen = max((int(c.max()) for c in counts.values()), default=0)
        return int(all_reduce_max([float(seen)])[0])

    def reference(self) -> None:
        """Serial and DBO outputs; the LL row bound; their agreement."""
        self.sms.set(self.opts.num_sms[0] if self.opts.num_sms else None)
        self.use(self.pf, "serial")
        self.serial()  # warm-up (the LL buffer layout, cuBLAS handles)
        self.dbo()
        if self.batched and self.opts.ll_rows == "auto":
            # the merged call's slab holds both ubatches' rows of an expert
            for mode, fn, pf, calls in (("serial", self.serial, self.pf, 1),
                                        ("dbo", self.dbo, self.pf_dbo, 1),
                                        ("merged", self.merged, self.pf_dbo, 2)):
                cap = pf.max_num_tokens_per_rank() * pf.num_dispatchers() * calls
                self.rows[mode] = _round_rows(self._rows_received(pf, fn, mode), cap)
        elif self.batched and self.opts.ll_rows == "full":
            cap = self.pf.max_num_tokens_per_rank() * self.pf.num_dispatchers()
            self.rows = {"serial": cap, "dbo": cap, "merged": 2 * cap}
        elif self.batched and self.opts.ll_rows != "masked":
            n = int(self.opts.ll_rows)
            self.rows = {"serial": n, "dbo": n, "merged": 2 * n}
        self.rec.ll_rows = dict(self.rows) if self.batched else None
        self.use(self.pf, "serial")
        self.ref = self.serial()
        self.use(self.pf, "dbo")
        self.ref_dbo = self.dbo()
        self.check_against(self.ref, "dbo_vs_serial")(self.ref_dbo)
        if "merged" in self.opts.modes or "merged_compute" in self.opts.modes:
            self.use(self.pf, "merged")
            self.check_against(self.ref, "merged_vs_serial")(self.merged())
        if "sbo_dbo" in self.opts.modes:
            self.use(self.pf, "sbo_dbo")
            self.check_against(self.ref, "sbo_dbo_vs_serial")(self.sbo_dbo())
        self.rec.plan = str(self.plan)

    def compute_alone(self) -> None:
        modes = self.opts.modes
        if not {"compute", "dbo_compute", "merged_compute"} & set(modes):
            return
        records: dict[str, dict] = {}
        for mode, fn in (("serial", self.serial), ("dbo", self.dbo)):
            recorder = RecordingPrepareAndFinalize(self.pf_dbo if mode == "dbo" else self.pf)
            self.use(recorder, mode)
            recorder.begin_step()
            fn()
            records[mode] = recorder.records
        # the merged schedule dispatches as the split one does: it replays the same records
        for mode, src, fn in (("compute", "serial", self.serial), ("dbo_compute", "dbo", self.dbo),
                              ("merged_compute", "dbo", self.merged)):
            if mode not in modes:
                continue
            replay = ReplayPrepareAndFinalize(self.pf_dbo if src == "dbo" else self.pf, records[src])
            self.use(replay, mode)

            def step(replay=replay, fn=fn) -> torch.Tensor:
                replay.begin_step()
                return fn()

            def ready(replay=replay, mode=mode, step=step) -> Callable[[], torch.Tensor]:
                self.use(replay, mode)
                return step

            self.alone[mode] = ready
            self.run_config(mode, None, step)
        records.clear()

    def drop_alone(self) -> None:
        """Free the compute-alone and comm-alone steps once the shape is measured: they hold
        every layer's recorded receive (the serial step's and the split one's), about 1.7 GB a
        layer at 16384 tokens of DeepSeek-V3 per rank of EP 32, which the shapes measured after
        this one (the bench keeps its shapes for the autotune) would otherwise not have."""
        self.alone.clear()

    def comm_alone(self) -> None:
        if "comm" not in self.opts.modes:
            return
        self.use(self.pf, "serial")
        routing = self.model.record_routing(self.x)
        if self.opts.layout in COMM_BYTES_BACKENDS:  # for the comm column's link limit
            dims = self.model.dims
            world, rank = self.model.world_size, self.model.rank
            fp8 = bool(getattr(self.pf, "use_fp8_dispatch", False))
            per_layer = [comm_bytes(self.opts.layout, ids, world_size=world, rank=rank,
                                    num_experts=dims.num_experts, hidden=dims.hidden,
                                    elem_bytes=self.x.element_size(),
                                    dispatch_elem_bytes=FP8_DISPATCH_BYTES if fp8 else None)
                         for _, _, ids in routing]
            self.rec.comm_bytes_per_layer = sum(per_layer) / len(per_layer)
            if self.link is not None:
                self.rec.link_ms_per_layer = self.link.time_ms(self.rec.comm_bytes_per_layer)
        ident = IdentityExperts()
        kernels = [MoEKernel(self.pf, ident) for _ in range(self.layers)]
        step = self.model.comm_step(kernels, routing)
        self.alone["comm"] = lambda: step
        for s in self.opts.num_sms or [None]:
            self.sms.set(s)
            self.run_config("comm", s, step)

    def serial_and_dbo(self) -> None:
        for s in self.opts.num_sms or [None]:
            self.sms.set(s)
            if "serial" in self.opts.modes:
                self.use(self.pf, "serial")
                self.run_config("serial", s, self.serial, self.check_against(self.ref, f"serial_s{s}"))
            if "dbo" in self.opts.modes:
                for k in self.opts.dbo_sm_carveout:
                    self.use(self.pf_dbo, "dbo")
                    self.carveout = k
                    name = f"dbo_s{s}" + ("" if k is None else f"_k{k}")
                    self.run_config("dbo", s, self.dbo, self.check_against(self.ref, name), carveout=k)
                self.carveout = None
            if "sbo" in self.opts.modes:  # unsplit: the serial step's backend and rows
                self.use(self.pf, "serial")
                self.run_config("sbo", s, self.sbo, self.check_against(self.ref, f"sbo_s{s}"))
            if "merged" in self.opts.modes:
                for k in self.opts.dbo_sm_carveout:
                    self.use(self.pf_dbo, "merged")
                    self.carveout = k
                    name = f"merged_s{s}" + ("" if k is None else f"_k{k}")
                    self.run_config("merged", s, self.merged, self.check_against(self.ref, name),
                                    carveout=k)
                self.carveout = None
            if "sbo_dbo" in self.opts.modes:
                self.use(self.pf_dbo, "sbo_dbo")
                self.run_config("sbo_dbo", s, self.sbo_dbo, self.check_against(self.ref, f"sbo_dbo_s{s}"))

    def best(self, mode: str) -> tuple[int | None, int | None]:
        """The DeepEP SM count and SM carve-out of the fastest ``mode`` run."""
        m = best_measurement(self.rec.measurements, mode)
        if m is None:
            return (self.opts.num_sms[0] if self.opts.num_sms else None), None
        return m.num_sms, m.sm_carveout

    def step(self, mode: str) -> Callable[[], torch.Tensor]:
        """The step of ``mode``: "serial", "dbo", "merged", "sbo" or "sbo_dbo"."""
        return {"serial": self.serial, "dbo": self.dbo, "merged": self.merged, "sbo": self.sbo,
                "sbo_dbo": self.sbo_dbo}[mode]

    def use_best(self, mode: str) -> None:
        """Run the next ``mode`` steps ("serial", "dbo", "merged", "sbo_dbo"; "sbo" runs the
        serial step's kernels, so in serial's) in its fastest configuration."""
        mode = "serial" if mode == "sbo" else mode
        s, k = self.best(mode)
        self.sms.set(s)
        self.use(self.pf, mode)
        self.carveout = k if mode in ("dbo", "merged", "sbo_dbo") else None

    def adaptive_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model's forward with each mode's best configuration: the one DBO measured best
        inside a run, the one serial measured best outside (what a tuned wrapper runs).

        The kernels of both configurations are built once here and swapped in per call, so a
        call costs what the serial and DBO measurements cost (a fresh ``MoEKernel`` per call
        would allocate its per-ubatch workspaces again every step). The best DBO run's SM
        carve-out is not set here but by the overlapped run (its ``sm_carveout``: ``best("dbo")[1]``).
        """
        (s_ser, _), (s_dbo, _) = self.best("serial"), self.best("dbo")
        self.use(self.pf, "serial")
        k_ser = self.model.kernels
        self.use(self.pf, "dbo")
        k_dbo = self.model.kernels
        rows_ser, rows_dbo, rows_merged = self.rows["serial"], self.rows["dbo"], self.rows["merged"]
        model, experts, sms = self.model, self.experts, self.sms

        def fn(x: torch.Tensor) -> torch.Tensor:
            in_dbo = dbo.dbo_enabled()
            sms.set(s_dbo if in_dbo else s_ser)  # a no-op unless it changes
            model.kernels = k_dbo if in_dbo else k_ser
            merged = in_dbo and current_expert_schedule() is ExpertSchedule.MERGED
            experts.batched_rows = rows_merged if merged else rows_dbo if in_dbo else rows_ser
            return model(x)

        return fn
