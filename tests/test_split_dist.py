"""dbo.split's agreement over a real gloo group of 2 ranks: every rank splits or none does, with
the same padded size; the plans equal what the pure passes predict for the same votes; and each
agreement rule (thresholds, switches, empty ranks, empty ubatches, batch kinds, CUDA-graph sizes,
config mismatches) as a worked example."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from dbo.split import (
    DISABLE_ENV_VAR,
    FALLBACK_LOG,
    SplitConfig,
    SplitReason,
    encode_vote,
    local_vote,
    plan_ubatches,
    resolve_plan,
)
from dbo.testing.dist import DistWorld

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

WORLD = 2


def _plans_job(cases: list[dict]) -> list[tuple]:
    """Plan every case on this rank; a case gives per-rank tokens and switches."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for case in cases:
        cfg = SplitConfig(**case["config"], enabled=not case["disabled"][rank])
        if case["env_off"][rank]:
            os.environ[DISABLE_ENV_VAR] = "1"
        try:
            plan = plan_ubatches(case["tokens"][rank], cfg, decode_only=case["decode_only"][rank])
        finally:
            os.environ.pop(DISABLE_ENV_VAR, None)
        out.append((plan.slices, plan.padded_size, plan.reason.value))
    return out


def _predicted(case: dict) -> list[tuple]:
    """What the pure passes say each rank's plan is (no collective)."""
    decisions, configs = [], []
    for r in range(WORLD):
        cfg = SplitConfig(**case["config"], enabled=not (case["disabled"][r] or case["env_off"][r]))
        configs.append(cfg)
        decisions.append(local_vote(case["tokens"][r], cfg, decode_only=case["decode_only"][r]))
    reduced = [max(c) for c in zip(*(encode_vote(d, c) for d, c in zip(decisions, configs, strict=True)),
                                   strict=True)]
    out = []
    for r in range(WORLD):
        p = resolve_plan(case["tokens"][r], decisions[r], configs[r], reduced)
        out.append((p.slices, p.padded_size, p.reason.value))
    return out


def _pair(elements):
    return st.lists(elements, min_size=WORLD, max_size=WORLD)


case_strategy = st.fixed_dictionaries({
    "tokens": _pair(st.one_of(st.just(0), st.integers(0, 40), st.integers(0, 2000))),
    "decode_only": _pair(st.booleans()),
    "disabled": _pair(st.sampled_from([False] * 7 + [True])),
    "env_off": _pair(st.sampled_from([False] * 7 + [True])),
    "config": st.fixed_dictionaries({
        "num_ubatches": st.integers(2, 3),
        "decode_token_threshold": st.integers(0, 64),
        "prefill_token_threshold": st.sampled_from([0, 16, 512]),
        "pad_to_multiple": st.sampled_from([1, 8]),
        "mode": st.sampled_from(["tokens", "fill"]),
        "cudagraph_sizes": st.sampled_from([(), (24, 48, 96, 384, 1536)]),
        "allow_mixed_kinds": st.booleans(),
    }),
})


@settings(max_examples=4)
@given(cases=st.lists(case_strategy, min_size=10, max_size=20))
def test_ranks_agree(world2, cases):
    per_rank = world2.run(_plans_job, cases)
    for i, case in enumerate(cases):
        got = [per_rank[r][i] for r in range(WORLD)]
        note(f"case {i}: {case} -> {got}")
        splits = {reason == SplitReason.SPLIT.value for _, _, reason in got}
        assert len(splits) == 1, "ranks disagree on whether to split"
        if splits == {True}:
            assert len({padded for _, padded, _ in got}) == 1
            assert len({len(slices) for slices, _, _ in got}) == 1
        assert got == _predicted(case)


def _examples_job() -> list[tuple]:
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = SplitConfig(prefill_token_threshold=10)
    out = []
    FALLBACK_LOG.reset()
    for tokens in ([100, 30], [100, 0], [100, 5], [0, 0]):
        plan = plan_ubatches(tokens[rank], cfg)
        out.append((plan.slices, plan.padded_size, plan.reason.value))
    out.append(tuple(sorted(r.value for r in FALLBACK_LOG.seen)))
    FALLBACK_LOG.reset()
    return out


def test_examples(world2):
    r0, r1 = world2.run(_examples_job)
    # uneven: the smaller rank pads to the larger rank's ubatch size
    assert r0[0] == (((0, 50), (50, 100)), 50, "split") and r1[0] == (((0, 15), (15, 30)), 50, "split")
    # an empty rank abstains and runs padding only
    assert r1[1] == (((0, 0), (0, 0)), 50, "split")
    # a rank below its threshold vetoes; the other logs a disagreement
    assert (r0[2][2], r1[2][2]) == ("disagreement", "below_threshold")
    assert r0[3][2] == r1[3][2] == "empty"
    assert r0[4] == ("disagreement", "empty") and r1[4] == ("below_threshold", "empty")


def _mismatch_job() -> str:
    import torch.distributed as dist

    cfg = SplitConfig(num_ubatches=2 + dist.get_rank(), prefill_token_threshold=0)
    try:
        plan_ubatches(64, cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_num_ubatches_mismatch_raises_on_every_rank(world2):
    msgs = world2.run(_mismatch_job)
    assert all("num_ubatches differs across ranks" in m for m in msgs), msgs


# ---- each agreement rule, worked on two ranks ----------------------------------------------

DECODE = {"num_tokens": 64, "request_token_counts": [1] * 64}
PREFILL = {"num_tokens": 64, "request_token_counts": [32, 32]}
ALWAYS = {"decode_token_threshold": 0, "prefill_token_threshold": 0}

#: (name, config kwargs, per-rank plan_ubatches kwargs)
RULE_CASES = [
    ("uneven", {"prefill_token_threshold": 10}, [{"num_tokens": 100}, {"num_tokens": 30}]),
    ("empty rank", {"prefill_token_threshold": 10}, [{"num_tokens": 100}, {"num_tokens": 0}]),
    ("below threshold", {"prefill_token_threshold": 10}, [{"num_tokens": 100}, {"num_tokens": 5}]),
    ("all empty", {}, [{"num_tokens": 0}, {"num_tokens": 0}]),
    ("disabled", {"prefill_token_threshold": 0}, [{"num_tokens": 100}, {"num_tokens": 100, "off": True}]),
    ("padding-only ubatch", {"prefill_token_threshold": 0}, [{"num_tokens": 100}, {"num_tokens": 1}]),
    ("fill: last ubatch empty", {"mode": "fill", "prefill_token_threshold": 0},
     [{"num_tokens": 100}, {"num_tokens": 30}]),
    ("fill: fits", {"mode": "fill", "prefill_token_threshold": 0}, [{"num_tokens": 100}, {"num_tokens": 60}]),
    ("mixed kinds", ALWAYS, [DECODE, PREFILL]),
    ("mixed kinds allowed", {**ALWAYS, "allow_mixed_kinds": True}, [DECODE, PREFILL]),
    ("mixed kinds, empty rank", {"decode_token_threshold": 0},
     [DECODE, {"num_tokens": 0, "request_token_counts": []}]),
    ("cuda graph", {"prefill_token_threshold": 0, "cudagraph_sizes": (16, 32, 64, 128)},
     [{"num_tokens": 20}, {"num_tokens": 40}]),
    ("requests: zero-token request", {"mode": "requests", "prefill_token_threshold": 0},
     [{"num_tokens": 5, "request_token_counts": [0, 5]}, {"num_tokens": 6, "request_token_counts": [3, 3]}]),
    ("two-chunk", {"mode": "requests", "prefill_token_threshold": 0, "two_chunk_threshold": 0.48},
     [{"num_tokens": 20, "request_token_counts": [18, 2]},
      {"num_tokens": 10, "request_token_counts": [5, 5]}]),
    ("caller points", {"prefill_token_threshold": 0},
     [{"num_tokens": 10, "split_points": [8]}, {"num_tokens": 10}]),
]


def _rules_job(cases: list) -> list[tuple]:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for _, cfg_kw, per_rank in cases:
        kw = dict(per_rank[rank])
        cfg = SplitConfig(**cfg_kw, enabled=not kw.pop("off", False))
        plan = plan_ubatches(kw.pop("num_tokens"), cfg, **kw)
        out.append((plan.slices, plan.padded_size, plan.reason.value, plan.graph_size, plan.two_chunk))
    return out


EXPECTED = {
    "uneven": [(((0, 50), (50, 100)), 50, "split"), (((0, 15), (15, 30)), 50, "split")],
    "empty rank": [(((0, 50), (50, 100)), 50, "split"), (((0, 0), (0, 0)), 50, "split")],
    "below threshold": [(((0, 100),), 100, "disagreement"), (((0, 5),), 5, "below_threshold")],
    "all empty": [(((0, 0),), 0, "empty")] * 2,
    "disabled": [(((0, 100),), 100, "disagreement"), (((0, 100),), 100, "disabled")],
    "padding-only ubatch": [(((0, 100),), 100, "disagreement"), (((0, 1),), 1, "empty_ubatch")],
    "fill: last ubatch empty": [(((0, 100),), 100, "empty_ubatch"), (((0, 30),), 30, "empty_ubatch")],
    "fill: fits": [(((0, 50), (50, 100)), 50, "split"), (((0, 50), (50, 60)), 50, "split")],
    "mixed kinds": [(((0, 64),), 64, "mixed_kinds")] * 2,
    "mixed kinds allowed": [(((0, 32), (32, 64)), 32, "split")] * 2,
    "mixed kinds, empty rank": [(((0, 32), (32, 64)), 32, "split"), (((0, 0), (0, 0)), 32, "split")],
    "cuda graph": [(((0, 10), (10, 20)), 32, "split"), (((0, 20), (20, 40)), 32, "split")],
    "requests: zero-token request": [(((0, 5),), 5, "too_few_requests"), (((0, 6),), 6, "disagreement")],
    "two-chunk": [(((0, 10), (10, 20)), 10, "split"), (((0, 5), (5, 10)), 10, "split")],
    "caller points": [(((0, 8), (8, 10)), 8, "split"), (((0, 5), (5, 10)), 8, "split")],
}


def test_each_agreement_rule(world2):
    per_rank = world2.run(_rules_job, RULE_CASES)
    for i, (name, _, _) in enumerate(RULE_CASES):
        got = [per_rank[r][i][:3] for r in range(WORLD)]
        assert got == EXPECTED[name], f"{name}: {got}"
    by_name = {name: [per_rank[r][i] for r in range(WORLD)] for i, (name, _, _) in enumerate(RULE_CASES)}
    assert [g[3] for g in by_name["cuda graph"]] == [64, 64]  # the whole batch pads to a captured size
    assert [g[4] for g in by_name["two-chunk"]] == [True, False]  # rank 0 cut its long request


def _config_mismatch_job() -> str:
    import torch.distributed as dist

    cfg = SplitConfig(prefill_token_threshold=0, cudagraph_sizes=(64,) if dist.get_rank() else ())
    try:
        plan_ubatches(64, cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_config_mismatch_raises_on_every_rank(world2):
    msgs = world2.run(_config_mismatch_job)
    assert all("SplitConfig differs across ranks" in m for m in msgs), msgs




def _silent_peer_job(timeout_s: float, host_vote: bool) -> str:
    # both ranks decide once (a group's first decision opens its vote board, collectively);
    # then rank 1 stops voting (its process lives on, waiting for the next job): rank 0's next
    # decision raises once the collective_timeout passes, where it would wait for the process
    # group's own timeout (minutes) without one
    import os
    import time

    import torch.distributed as dist

    from dbo.errors import CollectiveTimeoutError
    from dbo.peers.watchdog import collective_timeout

    os.environ["DBO_HOST_VOTE"] = "1" if host_vote else "0"
    config = SplitConfig(prefill_token_threshold=512)
    plan_ubatches(600, config)
    if dist.get_rank() != 0:
        return "silent"
    t0 = time.monotonic()
    try:
        with collective_timeout(timeout_s):
            plan_ubatches(600, config)
    except CollectiveTimeoutError as exc:
        assert exc.phase == "split decision" and "rank 0 waited" in str(exc), exc
        return f"raised after {time.monotonic() - t0:.1f} s"
    return "decided"


@pytest.mark.parametrize("host_vote", [True, False], ids=["shared memory", "gloo"])
def test_a_silent_peer_fails_the_decision_within_the_collective_timeout(host_vote):
    # its own world: a timed-out gloo collective leaves the group unusable
    with DistWorld(2) as w:
        out = w.run(_silent_peer_job, 1.0, host_vote, timeout_s=30.0)
    assert out[1] == "silent" and out[0].startswith("raised after"), out
    assert float(out[0].split()[2]) < 10.0, out  # the 1 s timeout, with 10x slack


def _vote_paths_job() -> tuple:
    # the same decisions through the shared-memory board and through gloo
    import os

    import torch.distributed as dist

    from dbo.peers import hostvote

    rank = dist.get_rank()
    config = SplitConfig(prefill_token_threshold=100, decode_token_threshold=8)
    sizes = [(0, 5), (3, 300), (99, 101), (700, 20), (64, 64), (150, 300), (512, 512)]
    out = []
    for env in ("1", "0"):
        os.environ["DBO_HOST_VOTE"] = env
        plans = [plan_ubatches(pair[rank], config) for pair in sizes]
        out.append([(p.split, tuple(map(tuple, p.slices))) for p in plans])
    os.environ["DBO_HOST_VOTE"] = "1"
    board = hostvote.host_vote(None, len(encode_vote(local_vote(1, config), config)))
    return out[0] == out[1], board is not None, out[0]


def test_the_shared_memory_vote_decides_as_gloo(world2):
    results = world2.run(_vote_paths_job)
    assert all(same and board for same, board, _ in results), results
    splits = [split for split, _ in results[0][2]]
    assert any(splits) and not all(splits), splits  # both outcomes among the cases


def _private_shm_job(base: str) -> tuple:
    # ranks that share a hostname but not /dev/shm (a container each): the board's check sees
    # no peer's region, every rank gets None (gloo then), and no file is left behind
    import os

    import torch.distributed as dist

    from dbo.peers import hostboard
    from dbo.peers.hostvote import HostVote

    own = os.path.join(base, f"rank{dist.get_rank()}")
    os.makedirs(own, exist_ok=True)
    real = hostboard._shm_dir
    hostboard._shm_dir = lambda: own
    try:
        private = HostVote.open(None, 10)
    finally:
        hostboard._shm_dir = real
    shared = HostVote.open(None, 10)
    return private is None, shared is not None, sorted(os.listdir(own))


def test_the_board_falls_back_where_the_ranks_do_not_share_memory(world2, tmp_path):
    out = world2.run(_private_shm_job, str(tmp_path))
    assert all(private_none and shared_ok and files == [] for private_none, shared_ok, files in out), out


def _dead_peer_job() -> float:
    # rank 1 exits after the first decision; rank 0's next one fails within about a second,
    # with no collective_timeout in force (the board watches its peers' processes)
    import os
    import time

    import torch.distributed as dist

    from dbo.errors import CollectiveTimeoutError

    os.environ["DBO_HOST_VOTE"] = "1"
    config = SplitConfig(prefill_token_threshold=512)
    plan_ubatches(600, config)
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        plan_ubatches(600, config)
    except CollectiveTimeoutError as exc:
        assert "exited" in str(exc) and exc.missing_ranks == (1,), exc
        return time.monotonic() - t0
    return -1.0


def test_a_peer_that_exits_fails_the_decision_at_once():
    with DistWorld(2) as w:
        outcomes = w.run_outcomes(_dead_peer_job, timeout_s=30.0)
    assert outcomes[0].ok, outcomes[0].traceback
    assert 0 <= outcomes[0].value < 10.0, outcomes[0].value  # about 1 s; the group's timeout is 30 s


def _gpu_group_vote_job() -> tuple:
    # an NCCL group's collective device is a GPU: the vote of ranks on one host must not go
    # there (a GPU all-reduce read back holds the host until the GPU caught up) but through
    # the board; an explicit CUDA device keeps the all-reduce (here: the stand-in raises)
    import os

    import torch.distributed as dist

    from dbo.peers import collectives

    os.environ["DBO_HOST_VOTE"] = "1"
    rank = dist.get_rank()

    def on_the_gpu(group=None):
        raise RuntimeError("the vote went to the GPU")

    collectives.all_reduce_max([0, 0, 0], None)  # the group's board opened, as at a first vote
    real = collectives.collective_device
    collectives.collective_device = on_the_gpu
    try:
        voted = collectives.all_reduce_max([rank, 5 - rank, 7], None)
        try:
            collectives.all_reduce_max([rank, 1.5], None)  # floats: the all-reduce
            floats = "all-reduce not taken"
        except RuntimeError as exc:
            floats = str(exc)
    finally:
        collectives.collective_device = real
    return voted, floats


def test_a_vote_of_ranks_on_one_host_skips_the_groups_device(world2):
    results = world2.run(_gpu_group_vote_job)
    assert all(voted == [1, 5, 7] for voted, _ in results), results
    assert all(floats == "the vote went to the GPU" for _, floats in results), results
