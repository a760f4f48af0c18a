"""A deployment's DBO settings in a file: what the autotune chose, and for which deployment.

Tune once (on the deployment itself, or on one GPU playing one of its ranks with the emulated
backend), write the result, and load it where the model is served::

    python -m dbo.bench overlap --device cuda --emulate-ep 64 --link deepep-ib --cuda-graph \\
        --intermediate 2048 --tokens 64 256 512 --save-config dbo_ep64.json
    wrapper = DBOWrapper(model, load_deployment_config("dbo_ep64.json"), group=ep_group)

The file is JSON: ``split`` (every :class:`~dbo.split.SplitConfig` field: thresholds, expert
schedule, ...), ``sbo_groups`` (expert groups of the grouped schedules, for
:attr:`dbo.moe.MoEKernel.sbo_groups`), ``sm_carveout`` (the SMs the matmuls leave free while
the ubatches run, :class:`dbo.RunOptions`), and ``deployment``: what it was tuned for (group
size, layout, link, device, the token counts measured, the command), for the reader.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dbo.files import write_whole
from dbo.split import SplitConfig

__all__ = ["DeploymentConfig", "save_deployment_config", "load_deployment_config", "SCHEMA"]

SCHEMA = "dbo.deployment_config/1"


@dataclass(frozen=True)
class DeploymentConfig:
    """What to run for one deployment (see the module docstring)."""

    split: SplitConfig
    sbo_groups: int = 2
    sm_carveout: int | None = None
    deployment: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.split, SplitConfig):
            raise TypeError(f"split must be a SplitConfig, got {type(self.split).__name__}")
        if isinstance(self.sbo_groups, bool) or not isinstance(self.sbo_groups, int) or self.sbo_groups < 1:
            raise ValueError(f"sbo_groups must be an int >= 1, got {self.sbo_groups!r}")
        if self.sm_carveout is not None and (not isinstance(self.sm_carveout, int) or self.sm_carveout < 0):
            raise ValueError(f"sm_carveout must be None or an int >= 0, got {self.sm_carveout!r}")

    def as_dict(self) -> dict[str, Any]:
        split = {f.name: getattr(self.split, f.name) for f in dataclasses.fields(SplitConfig)}
        split["mode"] = self.split.mode.value
        split["expert_schedule"] = self.split.expert_schedule.value
        split["cudagraph_sizes"] = list(self.split.cudagraph_sizes)
        return {"schema": SCHEMA, "split": split, "sbo_groups": self.sbo_groups,
                "sm_carveout": self.sm_carveout, "deployment": self.deployment}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeploymentConfig:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"not a dbo deployment config (want schema {SCHEMA!r}, got "
                             f"{d.get('schema') if isinstance(d, dict) else type(d).__name__!r})")
        known = {f.name for f in dataclasses.fields(SplitConfig)}
        split = d.get("split", {})
        unknown = sorted(set(split) - known)
        if unknown:
            raise ValueError(f"deployment config: unknown split field {unknown[0]!r}")
        split = dict(split, cudagraph_sizes=tuple(split.get("cudagraph_sizes", ())))
        return cls(SplitConfig(**split), int(d.get("sbo_groups", 2)), d.get("sm_carveout"),
                   dict(d.get("deployment", {})))


def save_deployment_config(path: str | os.PathLike, config: DeploymentConfig) -> None:
    """Write ``config`` to ``path`` as JSON (:func:`dbo.files.write_whole`: a reader never sees
    half of it)."""
    write_whole(path, json.dumps(config.as_dict(), indent=1) + "\n")


def load_deployment_config(path: str | os.PathLike) -> DeploymentConfig:
    """Read a file :func:`save_deployment_config` wrote.

    Raises:
        FileNotFoundError: no such file. ValueError: not such a config (the message says why).
    """
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)}: not JSON ({exc})") from None
    return DeploymentConfig.from_dict(d)
