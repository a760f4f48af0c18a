"""A deployment's tuned settings in a file: written, read back equal, refused when not one, and
taken by DBOWrapper (its split config and carve-out)."""

from __future__ import annotations

import json

import pytest
import torch

from dbo import DBOWrapper, RunOptions
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


def test_the_deployments_sbo_groups_reach_every_moe_kernel_of_the_run():
    from dbo.backends import make_backend
    from dbo.backends.emulated import EMULATED
    from dbo.expert_schedule import current_sbo_groups, use_expert_schedule, use_sbo_groups
    from dbo.experts import SwiGLUExperts, relative_error
    from dbo.moe import MoEKernel

    seen = []
    cfg = DeploymentConfig(SplitConfig(adaptive=False), sbo_groups=4)
    DBOWrapper(lambda x: seen.append(current_sbo_groups()) or x, cfg, agree=False)(torch.zeros(4, 8))
    assert seen == [4] and current_sbo_groups() is None
    assert DBOWrapper(torch.nn.Identity(), cfg).options.sbo_groups == 4
    # a kernel under the sbo schedule combines once per group the run sets, whatever its own
    hidden, experts, topk, t = 2048, 16, 2, 12
    pf = make_backend("emulated", None, hidden=hidden, num_experts=experts, topk=topk, dtype=torch.bfloat16,
                      device="cpu", max_tokens_per_rank=t, ep_size=2, layout="deepep_ll")
    kernel = MoEKernel(pf, SwiGLUExperts())
    combines = []
    real = pf.buffer.low_latency_combine
    pf.buffer.low_latency_combine = lambda *a, **k: combines.append(1) or real(*a, **k)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(8, 64, hidden, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(8, hidden, 32, generator=g) * 0.05).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(t, experts, generator=g), -1), topk)
    plain = kernel(x, w1, w2, weights, ids, global_num_experts=experts)
    outs = {}
    for groups in (None, 4):
        combines.clear()
        with use_expert_schedule("sbo"), use_sbo_groups(groups):
            outs[groups] = kernel(x, w1, w2, weights, ids, global_num_experts=experts)
        assert len(combines) == (kernel.sbo_groups if groups is None else groups)
        assert relative_error(outs[groups], plain) < 1e-2
    EMULATED.reset()
    with pytest.raises(ValueError, match="sbo_groups"):
        RunOptions(sbo_groups=0)


def test_a_prefill_takes_a_deployment_as_the_wrapper_does():
    pytest.importorskip("transformers")
    from dbo.integrations.transformers import DBOPrefill
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    with torch.device("meta"):
        model = causal_lm_class("mixtral")(tiny_config("mixtral"))
    split = SplitConfig(prefill_token_threshold=4096, expert_schedule="merged", adaptive=False)
    prefill = DBOPrefill(model, DeploymentConfig(split, sbo_groups=4, sm_carveout=8))
    assert prefill.wrapper.config == split
    assert prefill.wrapper.options == RunOptions(sm_carveout=8, sbo_groups=4)
