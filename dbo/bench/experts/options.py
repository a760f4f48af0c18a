"""What ``python -m dbo.bench experts`` is asked for: one frozen, validated value
(:class:`ExpertsOptions`) that its command line builds and the run reads."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "TIMINGS", "DEFAULT_GRID", "ExpertsOptions"]

#: the layouts a case can have: a backend's STANDARD tokens, or low-latency BATCHED_EXPERTS slabs
LAYOUTS = ("standard", "batched")
#: how a call is timed: queued behind a GPU sleep (the GPU's time), or after a host sync
TIMINGS = ("device", "idle")
#: each layout's default grid: (intermediate, tokens, local experts)
DEFAULT_GRID = {"standard": ([256, 768, 2048], [1024 << i for i in range(7)], [32, 128, 256]),
                "batched": ([2048], [64, 256, 512], [8, 32, 128])}


@dataclass(frozen=True, kw_only=True)
class ExpertsOptions:
    """The grid (``hidden`` x ``intermediate`` x ``local_experts`` x ``tokens``) of a
    ``layout``, top-``topk`` routing (batched: over ``ranks`` ranks), ``steps`` timed calls per
    implementation and ``timing``, ``held_s`` seconds of held GEMM for the held limit (0: not),
    ``baseline_only`` (the library's experts alone) and ``json`` (where the rows go, or None).

    Raises:
        ValueError: a bad value or combination, in one line naming the option.
    """

    layout: str = "standard"
    hidden: tuple[int, ...] = (7168,)
    intermediate: tuple[int, ...]
    tokens: tuple[int, ...]
    local_experts: tuple[int, ...]
    ranks: int = 2
    baseline_only: bool = False
    topk: int = 8
    steps: int = 30
    timing: tuple[str, ...] = TIMINGS
    held_s: float = 2.0
    json: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "tokens", "local_experts", "timing"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout}: must be one of {', '.join(LAYOUTS)}")
        for name in ("hidden", "intermediate", "tokens", "local_experts"):
            value = getattr(self, name)
            if not value or min(value) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {list(value)}")
        if self.ranks < 1 or self.steps < 1 or self.topk < 1:
            raise ValueError(f"--ranks, --steps and --topk must be positive, got {self.ranks}, {self.steps}, "
                             f"{self.topk}")
        if self.layout == "batched" and self.topk > min(self.local_experts) * self.ranks:
            raise ValueError(f"--topk {self.topk} is more than the {min(self.local_experts) * self.ranks} "
                             f"experts of --local-experts {min(self.local_experts)} x --ranks {self.ranks}")
        bad = [t for t in self.timing if t not in TIMINGS]
        if bad or not self.timing:
            raise ValueError(f"--timing {' '.join(self.timing)}: want one or both of {', '.join(TIMINGS)}")
        if self.held_s < 0:
            raise ValueError(f"--held-s {self.held_s}: must be >= 0 (0: no held limit)")
