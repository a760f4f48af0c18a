"""Property tests of dbo.split: cut points, thresholds, padding, and the group's agreement
(simulated here by an element-wise MAX over the ranks' vote vectors; the real all-reduce on
gloo is in test_split_dist.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from dbo.split import (
    DISABLE_ENV_VAR,
    FALLBACK_LOG,
    SplitConfig,
    SplitMode,
    SplitReason,
    Vote,
    encode_vote,
    local_vote,
    mask_padding_routing,
    no_split_plan,
    plan_ubatches,
    resolve_plan,
    split_requests,
    split_tokens,
)


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV_VAR, raising=False)
    FALLBACK_LOG.reset()
    yield
    FALLBACK_LOG.reset()


def assert_covers(slices, num_tokens):
    """Every token lands in exactly one slice, in order."""
    assert slices[0][0] == 0
    assert slices[-1][1] == num_tokens
    for (a, b), (c, _) in zip(slices, slices[1:], strict=False):
        assert a <= b == c
    assert all(a <= b for a, b in slices)


# ---- cut points ----------------------------------------------------------------------------


@given(st.integers(0, 5000), st.integers(1, 8))
def test_split_tokens_covers_evenly(num_tokens, n):
    slices = split_tokens(num_tokens, n)
    assert len(slices) == n
    assert_covers(slices, num_tokens)
    sizes = [b - a for a, b in slices]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(st.lists(st.integers(0, 300), min_size=0, max_size=30), st.integers(2, 6))
def test_split_requests_at_request_boundaries(counts, n):
    slices = split_requests(counts, n)
    note(f"slices={slices}")
    if slices is None:
        # fewer distinct request boundaries with tokens on both sides than cuts needed
        inner = {sum(counts[:k]) for k in range(1, len(counts))} - {0, sum(counts)}
        assert len(inner) < n - 1
        return
    assert len(slices) == n
    assert_covers(slices, sum(counts))
    assert all(b > a for a, b in slices), "a ubatch with no real tokens"
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    # every cut is at a request boundary, and every ubatch holds at least one request: some
    # strictly increasing choice of request indices gives the cuts (zero-token requests make
    # the index of a boundary ambiguous, so check that one exists)
    last = -1
    for a, _ in slices:
        ks = [k for k, p in enumerate(prefix) if p == a and k > last]
        assert ks, f"cut at token {a} is not a request boundary after request {last}"
        last = ks[0]
    assert last <= len(counts) - 1


@given(st.lists(st.integers(0, 300), min_size=2, max_size=30))
def test_split_requests_two_ubatches_minimise_the_larger(counts):
    total = sum(counts)
    # cuts at request boundaries leaving a token on each side
    prefix = [p for p in (sum(counts[:k]) for k in range(1, len(counts))) if 0 < p < total]
    slices = split_requests(counts, 2)
    if not prefix:
        assert slices is None
        return
    (a0, b0), (a1, b1) = slices
    best = min(max(p, total - p) for p in prefix)
    assert max(b0 - a0, b1 - a1) == best


def test_split_requests_examples():
    assert split_requests([5, 1, 1, 1, 1, 1], 2) == ((0, 5), (5, 10))
    assert split_requests([1, 1, 1, 1], 2) == ((0, 2), (2, 4))
    assert split_requests([100], 2) is None
    assert split_requests([3, 3, 3], 3) == ((0, 3), (3, 6), (6, 9))
    # a zero-token request never makes a ubatch on its own (the REQUESTS-mode fix)
    assert split_requests([0, 5], 2) is None
    assert split_requests([0, 3, 0, 3, 0], 2) == ((0, 3), (3, 6))
    assert split_requests([2, 0, 0, 2], 3) is None


# ---- one rank's vote -----------------------------------------------------------------------


@given(st.integers(0, 2000), st.integers(0, 1000), st.integers(0, 1000), st.booleans())
@example(1, 0, 0, True)  # one token, no threshold: a ubatch would be padding only
def test_thresholds_respected(num_tokens, decode_thr, prefill_thr, decode_only):
    cfg = SplitConfig(decode_token_threshold=decode_thr, prefill_token_threshold=prefill_thr)
    d = local_vote(num_tokens, cfg, decode_only=decode_only)
    thr = decode_thr if decode_only else prefill_thr
    if num_tokens == 0:
        assert d.vote is Vote.ABSTAIN
    elif num_tokens < thr:
        assert d.vote is Vote.NO and d.reason is SplitReason.BELOW_THRESHOLD
    elif num_tokens < cfg.num_ubatches:  # one token per ubatch at least, or a ubatch of padding
        assert d.vote is Vote.NO and d.reason is SplitReason.EMPTY_UBATCH
    else:
        assert d.vote is Vote.YES
        assert_covers(d.slices, num_tokens)


def test_decode_only_is_inferred_from_request_counts():
    cfg = SplitConfig()  # decode 32, prefill 512
    assert local_vote(64, cfg, request_token_counts=[1] * 64).vote is Vote.YES
    assert local_vote(64, cfg, request_token_counts=[2] * 32).vote is Vote.NO
    assert local_vote(64, cfg).vote is Vote.NO  # unknown kind: the prefill threshold
    assert local_vote(64, cfg, decode_only=True).vote is Vote.YES


def test_default_thresholds_are_documented_values():
    cfg = SplitConfig()
    assert (cfg.decode_token_threshold, cfg.prefill_token_threshold, cfg.num_ubatches) == (32, 512, 2)


def test_requests_mode_needs_counts_and_enough_requests():
    cfg = SplitConfig(mode="requests", prefill_token_threshold=0)
    with pytest.raises(ValueError, match="request_token_counts"):
        local_vote(10, cfg)
    d = local_vote(10, cfg, request_token_counts=[10])
    assert d.vote is Vote.NO and d.reason is SplitReason.TOO_FEW_REQUESTS
    d = local_vote(10, cfg, request_token_counts=[0, 10, 0])
    assert d.vote is Vote.NO and d.reason is SplitReason.TOO_FEW_REQUESTS


def test_env_var_and_config_switch_off(monkeypatch):
    cfg = SplitConfig(prefill_token_threshold=0)
    assert local_vote(100, cfg).vote is Vote.YES
    assert local_vote(100, SplitConfig(enabled=False)).reason is SplitReason.DISABLED
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    plan = plan_ubatches(100, cfg)
    assert not plan.split and plan.reason is SplitReason.DISABLED
    monkeypatch.setenv(DISABLE_ENV_VAR, "0")
    assert plan_ubatches(100, cfg).split


@pytest.mark.parametrize("kwargs, match", [
    ({"num_ubatches": 1}, "num_ubatches"),
    ({"mode": "bogus"}, "mode"),
    ({"decode_token_threshold": -1}, "decode_token_threshold"),
    ({"pad_to_multiple": 0}, "pad_to_multiple"),
    ({"two_chunk_threshold": 0.6}, "two_chunk_threshold"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"cudagraph_sizes": (8, 0)}, "cudagraph_sizes"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SplitConfig(**kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_tokens"):
        plan_ubatches(-1)
    with pytest.raises(ValueError, match="sum"):
        plan_ubatches(10, request_token_counts=[3, 3])


# ---- agreement across a simulated group ----------------------------------------------------

rank_strategy = st.fixed_dictionaries({
    "num_tokens": st.integers(0, 600),
    "decode_only": st.booleans(),
    "disabled": st.sampled_from([False] * 5 + [True]),  # mostly enabled
})

KIND_CHECK_OFF = {"allow_mixed_kinds": True}


def simulate_group(ranks, cfg_kw):
    decisions, configs = [], []
    for r in ranks:
        cfg = SplitConfig(enabled=not r["disabled"], **cfg_kw)
        configs.append(cfg)
        decisions.append(local_vote(r["num_tokens"], cfg, decode_only=r["decode_only"]))
    vectors = [encode_vote(d, c) for d, c in zip(decisions, configs, strict=True)]
    reduced = [max(col) for col in zip(*vectors, strict=True)]
    plans = [resolve_plan(r["num_tokens"], d, c, reduced)
             for r, d, c in zip(ranks, decisions, configs, strict=True)]
    return decisions, plans


@given(
    ranks=st.lists(rank_strategy, min_size=1, max_size=6),
    n=st.integers(2, 4),
    decode_thr=st.integers(0, 64),
    prefill_thr=st.integers(0, 300),
    multiple=st.sampled_from([1, 1, 4, 16]),
    allow_mixed=st.booleans(),
)
def test_group_agrees(ranks, n, decode_thr, prefill_thr, multiple, allow_mixed):
    cfg_kw = {"num_ubatches": n, "decode_token_threshold": decode_thr,
              "prefill_token_threshold": prefill_thr, "pad_to_multiple": multiple,
              "allow_mixed_kinds": allow_mixed}
    decisions, plans = simulate_group(ranks, cfg_kw)
    for i, p in enumerate(plans):
        note(f"rank {i}: {ranks[i]} -> {decisions[i].vote.name} -> {p}")
    votes = [d.vote for d in decisions]
    splits = {p.split for p in plans}
    assert len(splits) == 1, "some ranks split and others did not"
    kinds = {d.decode for d in decisions if d.vote is Vote.YES}
    mixed = len(kinds) == 2 and not allow_mixed
    should_split = Vote.YES in votes and Vote.NO not in votes and not mixed
    assert splits == {should_split}
    # a rank with tokens never runs a ubatch of padding only
    assert all(p.num_valid(i) > 0 for p in plans if p.split and p.num_tokens
               for i in range(p.num_ubatches))
    for r, d, p in zip(ranks, decisions, plans, strict=True):
        assert_covers(p.slices, r["num_tokens"])
        if p.split:
            assert p.num_ubatches == n
            assert p.padded_size % multiple == 0
            assert all(p.num_valid(i) <= p.padded_size for i in range(n))
            assert p.padded_size == plans[0].padded_size
        else:
            assert p.slices == ((0, r["num_tokens"]),)
            # this rank's own reason when it voted no; otherwise it was outvoted
            if d.vote is Vote.NO:
                assert p.reason is d.reason
            elif d.vote is Vote.YES:
                assert p.reason is (SplitReason.MIXED_KINDS if mixed and Vote.NO not in votes
                                    else SplitReason.DISAGREEMENT)
    if should_split:
        # the padded size is the smallest multiple that holds the largest ubatch of any rank
        largest = max(b - a for p in plans for a, b in p.slices)
        assert plans[0].padded_size == -(-largest // multiple) * multiple


def test_group_examples():
    cfg = {"prefill_token_threshold": 10}
    r = {"decode_only": False, "disabled": False}
    # uneven counts: the smaller rank pads
    _, plans = simulate_group([{**r, "num_tokens": 100}, {**r, "num_tokens": 30}], cfg)
    assert [p.padded_size for p in plans] == [50, 50]
    assert plans[1].slices == ((0, 15), (15, 30)) and plans[1].num_padding(0) == 35
    # an empty rank abstains and pads everything
    _, plans = simulate_group([{**r, "num_tokens": 100}, {**r, "num_tokens": 0}], cfg)
    assert plans[1].split and plans[1].slices == ((0, 0), (0, 0)) and plans[1].padded_size == 50
    # a rank below the threshold vetoes
    _, plans = simulate_group([{**r, "num_tokens": 100}, {**r, "num_tokens": 5}], cfg)
    assert [p.reason for p in plans] == [SplitReason.DISAGREEMENT, SplitReason.BELOW_THRESHOLD]
    # everyone empty
    _, plans = simulate_group([{**r, "num_tokens": 0}] * 2, cfg)
    assert [p.reason for p in plans] == [SplitReason.EMPTY] * 2


def test_num_ubatches_mismatch_raises():
    cfg2 = SplitConfig(prefill_token_threshold=0)
    cfg3 = SplitConfig(num_ubatches=3, prefill_token_threshold=0)
    d2, d3 = local_vote(10, cfg2), local_vote(10, cfg3)
    reduced = [max(a, b) for a, b in zip(encode_vote(d2, cfg2), encode_vote(d3, cfg3), strict=True)]
    with pytest.raises(ValueError, match="num_ubatches differs"):
        resolve_plan(10, d2, cfg2, reduced)


# ---- plans, padding and logging ------------------------------------------------------------


@given(st.integers(5, 300), st.integers(2, 5), st.sampled_from([1, 8]))
def test_plan_accessors(num_tokens, n, multiple):
    plan = plan_ubatches(num_tokens, SplitConfig(num_ubatches=n, prefill_token_threshold=0,
                                                 pad_to_multiple=multiple))
    assert plan.split and plan.num_ubatches == n
    assert plan.token_offsets == tuple(a for a, _ in plan.slices)
    for i in range(n):
        mask = plan.valid_mask(i)
        assert mask.shape == (plan.padded_size,)
        assert int(mask.sum()) == plan.num_valid(i)
        assert bool(mask[: plan.num_valid(i)].all())
        assert plan.num_valid(i) + plan.num_padding(i) == plan.padded_size
    assert plan.valid_rows == tuple(b - a for a, b in plan.slices)
    assert all(v + p == plan.padded_size for v, p in zip(plan.valid_rows, plan.padding_rows, strict=True))
    assert "split(" in str(plan)


@given(st.integers(0, 20), st.integers(1, 4), st.integers(0, 25))
def test_mask_padding_routing(rows, topk, num_valid):
    ids = torch.randint(0, 8, (rows, topk))
    w = torch.rand(rows, topk)
    new_ids, new_w = mask_padding_routing(ids, w, num_valid)
    k = min(num_valid, rows)
    assert torch.equal(new_ids[:k], ids[:k]) and torch.equal(new_w[:k], w[:k])
    assert bool((new_ids[k:] == -1).all()) and bool((new_w[k:] == 0).all())


def test_mask_padding_routing_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        mask_padding_routing(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1), 1)


def test_fallback_logged_once_per_reason(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="dbo.split")
    for _ in range(3):
        assert plan_ubatches(4).reason is SplitReason.BELOW_THRESHOLD
    monkeypatch.setenv(DISABLE_ENV_VAR, "yes")
    for _ in range(3):
        assert plan_ubatches(4000).reason is SplitReason.DISABLED
    msgs = [r.getMessage() for r in caplog.records if r.name == "dbo.split"]
    assert len(msgs) == 2, msgs
    assert "below_threshold" in msgs[0] and "4 tokens < prefill/mixed threshold 512" in msgs[0]
    assert "disabled" in msgs[1] and DISABLE_ENV_VAR in msgs[1]
    assert FALLBACK_LOG.seen == {SplitReason.BELOW_THRESHOLD, SplitReason.DISABLED}
    FALLBACK_LOG.reset()
    plan_ubatches(4)
    assert len([r for r in caplog.records if r.name == "dbo.split"]) == 3


def test_no_split_plan():
    p = no_split_plan(7, SplitReason.BELOW_THRESHOLD, "x")
    assert not p.split and p.slices == ((0, 7),) and p.padded_size == 7
    with pytest.raises(ValueError):
        no_split_plan(7, SplitReason.SPLIT)


def test_requests_mode_plan():
    plan = plan_ubatches(10, SplitConfig(mode=SplitMode.REQUESTS, prefill_token_threshold=0),
                         request_token_counts=[4, 4, 2])
    assert plan.split and plan.slices == ((0, 4), (4, 10)) and plan.padded_size == 6
    assert not plan.two_chunk
    # balance 4/10 = 0.4 < 0.48: SGLang's two-chunk rule cuts the middle request in two
    plan = plan_ubatches(10, SplitConfig(mode=SplitMode.REQUESTS, prefill_token_threshold=0,
                                         two_chunk_threshold=0.48), request_token_counts=[4, 4, 2])
    assert plan.split and plan.two_chunk and plan.slices == ((0, 5), (5, 10)) and plan.padded_size == 5
