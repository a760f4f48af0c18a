"""A run's settings travel one way: :class:`dbo.RunOptions` (or the same loose keywords), set on
entry to the call and restored on exit, read where they are used (CPU only)."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo import DBOWrapper, RunOptions, overlapped_forward
from dbo.autotune import autotune_split_config
from dbo.expert_schedule import ExpertSchedule, current_expert_schedule, use_expert_schedule
from dbo.peers.watchdog import collective_timeout, current_timeout
from dbo.split import SplitConfig
from dbo.ubatch.sm import current_experts_sm_carveout, experts_sm_carveout, sm_carveout

ALWAYS = SplitConfig(decode_token_threshold=0, prefill_token_threshold=0, adaptive=False)


def settings() -> tuple:
    """Every per-run setting as the forward sees it."""
    return (dbo.dbo_enabled(), current_expert_schedule(), current_experts_sm_carveout(),
            torch._C._get_sm_carveout_experimental(), current_timeout())


class Recording:
    """A forward that notes the settings in force at each call (and in each ubatch, after a
    yield), and fails in ubatch 1 (or in a plain call) when asked."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple] = []
        self.fail = fail

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(settings())
        dbo.dbo_yield()
        self.seen.append(settings())
        if self.fail and (dbo.dbo_current_ubatch_id() == 1 or not dbo.dbo_enabled()):
            raise RuntimeError("boom")
        return x * 2


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("config", [ALWAYS, SplitConfig(enabled=False)], ids=["split", "plain"])
def test_a_runs_settings_hold_inside_it_and_are_restored_after(fail, config):
    fn = Recording(fail)
    options = RunOptions(sm_carveout=12, timeout_s=9.0)
    before = settings()
    # settings in force around the call: the run's replace them, and they come back after it
    with use_expert_schedule("merged"), experts_sm_carveout(3), collective_timeout(40.0), \
            sm_carveout(1):
        outside = settings()
        assert outside == (False, ExpertSchedule.MERGED, 1, 1, 40.0)
        try:
            overlapped_forward(fn, torch.ones(8, 2), config=config, agree=False, options=options)
            assert not fail
        except (dbo.UBatchError, RuntimeError) as exc:
            assert fail and "boom" in str(exc if exc.__cause__ is None else exc.__cause__)
        assert settings() == outside
    assert settings() == before
    if config.enabled:  # split: the run's carve-out, torch's too, in both ubatches after a yield
        assert fn.seen == [(True, ExpertSchedule.SPLIT, 12, 12, 9.0)] * 4
    else:  # plain: the schedule and the timeout; the carve-out around the call stays
        assert fn.seen == [(False, ExpertSchedule.PLAIN, 1, 1, 9.0)] * 2


def test_a_ubatchs_own_carveout_does_not_reach_the_other_ubatch():
    seen = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.dbo_current_ubatch_id()
        with experts_sm_carveout(20 if me == 0 else None):
            dbo.dbo_yield()  # the block spans the yield: the other ubatch runs meanwhile
            seen.append((me, current_experts_sm_carveout()))
        return x

    overlapped_forward(fn, torch.ones(8, 2), config=ALWAYS, agree=False, sm_carveout=7)
    assert sorted(seen) == [(0, 20), (1, 7)]


# ---- options= and the loose keywords ---------------------------------------------------------


def _runs(call) -> tuple[list, list]:
    """``call(fn, trace, **run)`` with the keywords, then with one RunOptions: what the forward
    saw and the trace's schedule, each way."""
    out = []
    for as_options in (False, True):
        fn, trace = Recording(), dbo.Trace()
        run = dict(trace=trace, sm_carveout=6, timeout_s=4.0)
        call(fn, **({"options": RunOptions(**run)} if as_options else run))
        out.append((fn.seen, trace.meta.get("expert_schedule"), len(trace.events) > 0))
    return out[0], out[1]


def test_options_and_keywords_give_the_same_overlapped_forward():
    keywords, options = _runs(lambda fn, **kw: overlapped_forward(fn, torch.ones(8, 2), config=ALWAYS,
                                                                  agree=False, **kw))
    assert keywords == options
    assert set(keywords[0]) == {(True, ExpertSchedule.SPLIT, 6, 6, 4.0)} and keywords[1] == "split"


def test_options_and_keywords_give_the_same_wrapper():
    keywords, options = _runs(lambda fn, **kw: DBOWrapper(fn, ALWAYS, agree=False, **kw)(torch.ones(8, 2)))
    assert keywords == options and keywords[2]
    w = DBOWrapper(lambda x: x, options=RunOptions(compute_sms=None, timeout_s=2.0))
    assert w.options == RunOptions(timeout_s=2.0) and w.timeout_s == 2.0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_options_and_keywords_give_the_same_autotune():
    seen = []
    for run in (dict(sm_carveout=6), dict(options=RunOptions(sm_carveout=6))):
        fn = Recording()
        result = autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [8], decode_only=False,
                                       warmup=0, steps=1, rounds=1, schedules=["split"], **run)
        seen.append((fn.seen, result.sm_carveout, result.carveouts_tried))
    assert seen[0] == seen[1]
    torch_default = torch._C._get_sm_carveout_experimental()
    assert set(seen[0][0]) == {(False, ExpertSchedule.SPLIT, None, torch_default, None),
                               (True, ExpertSchedule.SPLIT, 6, 6, None)}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_autotune_runs_every_timed_call_under_the_options_timeout():
    fn = Recording()
    autotune_split_config(fn, lambda t: [torch.zeros(t, 2)], [8], decode_only=False, warmup=0,
                          steps=1, rounds=1, schedules=["split"], options=RunOptions(timeout_s=8.0))
    assert {s[4] for s in fn.seen} == {8.0}


@pytest.mark.parametrize("entry", ["overlapped_forward", "DBOWrapper", "autotune"])
def test_options_and_a_keyword_together_are_a_type_error(entry):
    calls = {
        "overlapped_forward": lambda: overlapped_forward(lambda x: x, torch.ones(4, 2),
                                                         options=RunOptions(), sm_carveout=4),
        "DBOWrapper": lambda: DBOWrapper(lambda x: x, options=RunOptions(), timeout_s=1.0),
        "autotune": lambda: autotune_split_config(lambda x: x, lambda t: [torch.zeros(t, 2)], [8],
                                                  decode_only=False, options=RunOptions(),
                                                  compute_sms=2),
    }
    with pytest.raises(TypeError, match="not both"):
        calls[entry]()
    with pytest.raises(TypeError, match="RunOptions"):
        overlapped_forward(lambda x: x, torch.ones(4, 2), options={"sm_carveout": 4})


def test_a_deployments_carveout_fills_the_options_left_without_one():
    from dbo.deployment import DeploymentConfig

    cfg = DeploymentConfig(ALWAYS, sm_carveout=8)
    assert DBOWrapper(torch.nn.Identity(), cfg, options=RunOptions(timeout_s=1.0)).options == \
        RunOptions(sm_carveout=8, timeout_s=1.0, sbo_groups=cfg.sbo_groups)
    assert DBOWrapper(torch.nn.Identity(), cfg, options=RunOptions(sm_carveout=2)).sm_carveout == 2


def test_only_the_sm_module_writes_torchs_carveout():
    # torch's carve-out is process-wide: one place sets it, around a whole run, and restores it
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    writers = set()
    for folder in ("dbo", "backends", "examples", "tools"):
        for path in (root / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            if any(isinstance(n, ast.Attribute) and n.attr == "_set_sm_carveout_experimental"
                   for n in ast.walk(tree)):
                writers.add(path.relative_to(root).as_posix())
    assert writers == {"dbo/ubatch/sm.py"}


def test_a_prefill_takes_the_run_options_as_the_wrapper_does():
    pytest.importorskip("transformers")
    from dbo.integrations.transformers import DBOPrefill
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    with torch.device("meta"):
        model = causal_lm_class("mixtral")(tiny_config("mixtral"))
    options = RunOptions(sm_carveout=4, timeout_s=2.0)
    by_keywords = DBOPrefill(model, sm_carveout=4, timeout_s=2.0)
    assert by_keywords.wrapper.options == DBOPrefill(model, options=options).wrapper.options == options
    with pytest.raises(TypeError, match="not both"):
        DBOPrefill(model, options=RunOptions(), timeout_s=1.0)
