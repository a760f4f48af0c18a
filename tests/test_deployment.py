"""A deployment's tuned settings in a file: written, read back equal, refused when not one, and
taken by DBOWrapper (its split config and carve-out)."""

from __future__ import annotations

import json

import pytest
import torch

from dbo import DBOWrapper
from dbo.deployment import DeploymentConfig, load_deployment_config, save_deployment_config
from dbo.split import NEVER_SPLIT, SplitConfig


def test_a_config_round_trips_and_the_wrapper_takes_it(tmp_path):
    split = SplitConfig(decode_token_threshold=256, prefill_token_threshold=NEVER_SPLIT,
                        expert_schedule="sbo+dbo", adaptive=False, cudagraph_sizes=(64, 32))
    cfg = DeploymentConfig(split, sbo_groups=4, sm_carveout=8, deployment={"ep_size": 64})
    path = tmp_path / "ep64.json"
    save_deployment_config(path, cfg)
    back = load_deployment_config(path)
    assert back == cfg and back.deployment == {"ep_size": 64}
    wrapper = DBOWrapper(torch.nn.Identity(), back)
    assert wrapper.config == split and wrapper.sm_carveout == 8
    assert DBOWrapper(torch.nn.Identity(), back, sm_carveout=4).sm_carveout == 4


def test_what_is_not_a_config_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_deployment_config(bad)
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema"):
        load_deployment_config(bad)
    good = DeploymentConfig(SplitConfig()).as_dict()
    good["split"]["nope"] = 1
    bad.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="nope"):
        load_deployment_config(bad)
    with pytest.raises(ValueError, match="sbo_groups"):
        DeploymentConfig(SplitConfig(), sbo_groups=0)
