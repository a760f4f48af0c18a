"""What a run of the overlap benchmark measured, as typed records: a run
(:class:`OverlapResult`) holds its options, its environment and a :class:`ShapeRecord` per
shape; a shape holds its :class:`Measurement` list, its output :class:`Check` results and its
:class:`ShapeSummary` (its figures, computed by :func:`dbo.bench.overlap.summary.summarize`).

The measuring code fills them; the table, the plot, the verdict and the JSON bundle read them.
``to_json`` writes the bundle's ``bench_overlap.json`` (schema :data:`SCHEMA`, the keys it has
always had) and ``from_json`` reads one back, so ``from_json(r.to_json()).to_json() ==
r.to_json()``. Two parts stay plain dicts, as documented where they are made: the environment
(``env``, what :func:`dbo.bench.overlap.args.collect_env` found on the machine) and a shape's
``cuda_graph`` figures (:mod:`dbo.bench.overlap.capture`: keys per captured schedule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dbo.bench.overlap.options import OverlapOptions
from dbo.bench.timing import Timing

__all__ = ["SCHEMA", "Check", "Measurement", "SmsRow", "ShapeSummary", "ShapeRecord", "AutotuneRecord",
           "OverlapResult"]

SCHEMA = "dbo.bench_overlap/2"  # 2: one expert implementation (no expert_chunks)


@dataclass(frozen=True)
class Check:
    """An output against the serial reference: ``rel`` = ||out - ref|| / ||ref||;
    ``token_median``: the median over tokens of each token's relative error (both MAX over
    ranks)."""

    rel: float
    token_median: float

    def ok(self, tolerance: float) -> bool:
        """Whether the output matches (a NaN never does)."""
        return self.token_median <= tolerance


@dataclass(frozen=True)
class Measurement:
    """One timed configuration: ``mode`` (a mode of :data:`~dbo.bench.overlap.options.MODES`,
    or ``wrapper``, ``serial_paired`` and their ``_untuned`` twins), DeepEP's SM count
    ``num_sms`` and the DBO SM carve-out ``sm_carveout`` it ran with (None: not set), its
    ``timing`` (None when ``skipped`` says why it was not run), and ``rounds`` where it was
    timed in alternation with another (the best of that many)."""

    mode: str
    num_sms: int | None = None
    sm_carveout: int | None = None
    timing: Timing | None = None
    skipped: str | None = None
    rounds: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode, "num_sms": self.num_sms, "sm_carveout": self.sm_carveout}
        if self.rounds is not None:
            d["rounds"] = self.rounds
        if self.timing is not None:
            d["timing"] = self.timing.to_json()
        if self.skipped is not None:
            d["skipped"] = self.skipped
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Measurement:
        timing = d.get("timing")
        return cls(d["mode"], d.get("num_sms"), d.get("sm_carveout"),
                   None if timing is None else Timing(**timing), d.get("skipped"), d.get("rounds"))


@dataclass(frozen=True)
class SmsRow:
    """The best serial and DBO runs at one DeepEP SM count (``num_sms``), per layer in ms;
    ``speedup`` and ``efficiency`` against the best serial run overall."""

    num_sms: int
    comm_ms: float | None
    serial_ms: float | None
    dbo_ms: float | None
    dbo_config: str
    speedup: float | None
    efficiency: float | None


@dataclass(frozen=True)
class ShapeSummary:
    """One shape's figures (defined in :mod:`dbo.bench.overlap.summary`, which computes them);
    times per layer in ms, None where the mode was not run. ``*_config``: the configuration of
    the fastest run (``s24 k16``: DeepEP SMs, DBO carve-out; ``-``: none)."""

    compute_ms: float | None
    compute_config: str
    comm_ms: float | None
    comm_config: str
    serial_ms: float | None
    serial_config: str
    dbo_ms: float | None
    dbo_config: str
    dbo_compute_ms: float | None
    speedup: float | None
    efficiency: float | None
    comm_share: float | None
    ideal_ms: float | None
    peak_ratio: float | None
    peak_extra_ratio: float | None
    default_config_splits: bool
    merged_ms: float | None
    merged_config: str
    merged_compute_ms: float | None
    merged_speedup: float | None
    merged_efficiency: float | None
    sbo_ms: float | None
    sbo_speedup: float | None
    sbo_dbo_ms: float | None
    sbo_dbo_speedup: float | None
    best_schedule: str | None
    comm_bytes: float | None
    link_ms: float | None
    comm_x_link: float | None
    limit_ms: float | None
    compute_x_limit: float | None
    dbo_compute_over_compute: float | None
    merged_compute_over_compute: float | None
    wrapper_ms: float | None
    wrapper_measured: bool
    serial_paired_ms: float | None
    wrapper_vs_serial: float | None
    wrapper_vs_serial_unpaired: float | None
    untuned_wrapper_ms: float | None
    untuned_wrapper_vs_serial: float | None
    online_choice: str | None
    per_num_sms: tuple[SmsRow, ...] = ()
    #: "autotuned" where ``wrapper`` was timed with the autotune's config
    wrapper_config: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_num_sms"] = [asdict(r) for r in self.per_num_sms]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShapeSummary:
        return cls(**{**d, "per_num_sms": tuple(SmsRow(**r) for r in d.get("per_num_sms", ()))})


@dataclass
class ShapeRecord:
    """Everything measured at one shape (``tokens`` per rank, routed-expert ``intermediate``
    size) on a ``layers``-layer model; filled while the shape is measured.

    ``checks`` are by name (``dbo_vs_serial``, ``serial_s24``, ``dbo_sNone_k16``, ``wrapper``,
    ...); ``ll_rows``: deepep_ll's row bound per schedule (None on other layouts);
    ``comm_bytes_per_layer`` and ``link_ms_per_layer``: the bytes out of a rank and their link
    limit (:mod:`dbo.bench.overlap.link`); ``limit_ms_per_layer``: the compute limit per part
    and ``total`` (:func:`dbo.bench.limits.layer_limit_ms`); ``trace_files``: the profiled
    shape's traces and timelines by name; ``online_choice``: the untuned wrapper's measured
    choice (``chose``, ``table``); ``skipped``: why the shape was not measured.
    """

    backend: str
    tokens: int
    intermediate: int
    shared_intermediate: int
    layers: int
    measurements: list[Measurement] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    flops_per_token_per_layer: dict[str, float] | None = None
    limit_ms_per_layer: dict[str, float] | None = None
    ll_rows: dict[str, int | None] | None = None
    plan: str | None = None
    comm_bytes_per_layer: float | None = None
    link_ms_per_layer: float | None = None
    trace_files: dict[str, str] = field(default_factory=dict)
    online_choice: dict[str, Any] | None = None
    cuda_graph: dict[str, Any] | None = None
    skipped: str | None = None
    summary: ShapeSummary | None = None

    @property
    def label(self) -> str:
        return f"T={self.tokens} I={self.intermediate}"

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items()}
        d["measurements"] = [m.to_json() for m in self.measurements]
        d["checks"] = {k: asdict(c) for k, c in self.checks.items()}
        d["summary"] = None if self.summary is None else self.summary.to_json()
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShapeRecord:
        summary = d.get("summary")
        return cls(**{**d,
                      "measurements": [Measurement.from_json(m) for m in d.get("measurements", ())],
                      "checks": {k: Check(**c) for k, c in d.get("checks", {}).items()},
                      "summary": None if summary is None else ShapeSummary.from_json(summary)})


@dataclass(frozen=True)
class AutotuneRecord:
    """:func:`dbo.autotune.autotune_split_config` over one intermediate size's token counts:
    the threshold and schedule it chose (``never_split``: it found no size where DBO wins by
    ``margin``), its ``rows`` of measurements and their ``table``; ``ok`` False with the
    ``error`` that kept it from running."""

    ok: bool
    error: str | None = None
    decode_only: bool | None = None
    threshold: int | None = None
    schedule: str | None = None
    never_split: bool | None = None
    margin: float | None = None
    rows: tuple[dict[str, Any], ...] = ()
    table: str | None = None

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {"ok": False, "error": self.error}
        d = asdict(self)
        del d["error"]
        d["rows"] = list(self.rows)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AutotuneRecord:
        return cls(**{**d, "rows": tuple(d.get("rows", ()))})


@dataclass
class OverlapResult:
    """A run: its ``options`` (the bundle's ``args``), ``env``, a record per shape, the
    autotune per intermediate size, and what the run has to say: ``warnings``, ``notes`` (a
    CPU run's missed speed targets, expected there), ``crossover`` (deepep_ll: from which
    token count DBO wins, per intermediate size; None elsewhere), ``files`` (the bundle's
    files by role; ``plot`` None without matplotlib). ``partial`` while shapes are still to
    come."""

    options: OverlapOptions
    env: dict[str, Any]
    shapes: list[ShapeRecord] = field(default_factory=list)
    autotune: dict[int, AutotuneRecord] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str | None] = field(default_factory=dict)
    crossover: list[dict[str, Any]] | None = None
    partial: bool = False

    @property
    def dbo_disabled(self) -> bool:
        """Whether DBO_DISABLE was set: every plan was unsplit."""
        return bool(self.env.get("dbo_disabled"))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "partial": self.partial, "env": self.env,
                "args": self.options.to_json(), "shapes": [s.to_json() for s in self.shapes],
                "autotune": {str(k): v.to_json() for k, v in self.autotune.items()},
                "warnings": list(self.warnings), "files": dict(self.files), "notes": list(self.notes),
                "crossover": self.crossover}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OverlapResult:
        """A bundle's record; ValueError for a document that is not one."""
        schema = d.get("schema") if isinstance(d, Mapping) else None
        if schema != SCHEMA:
            raise ValueError(f"not an overlap bundle of schema {SCHEMA} (schema: {schema!r})")
        return cls(options=OverlapOptions.from_json(d["args"]), env=dict(d.get("env") or {}),
                   shapes=[ShapeRecord.from_json(s) for s in d.get("shapes", ())],
                   autotune={int(k): AutotuneRecord.from_json(v)
                             for k, v in (d.get("autotune") or {}).items()},
                   warnings=list(d.get("warnings", ())), notes=list(d.get("notes") or ()),
                   files=dict(d.get("files") or {}), crossover=d.get("crossover"),
                   partial=bool(d.get("partial", False)))
