"""The splitting rules engines use: two-chunk, caller points, filling to the padded
size, speculative decode, CUDA-graph padding, and the group's agreement on kinds and empty
ubatches. Hypothesis properties over simulated groups (an element-wise MAX of the ranks' vote
vectors, as the all-reduce does; the real one on gloo is in test_split_dist.py) plus worked
examples."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

from dbo.split import (
    SplitConfig,
    SplitMode,
    SplitReason,
    UBatchPlan,
    Vote,
    encode_vote,
    fill_cuts,
    graph_padded_size,
    local_vote,
    plan_ubatches,
    resolve_plan,
    split_at,
    split_requests,
    split_requests_two_chunk,
    split_tokens,
)
from dbo.split.policies import (
    SGLANG_TWO_CHUNK_THRESHOLD,
    is_uniform_decode,
    max_capacity_with_nonempty_last,
    min_fill_capacity,
    token_balance,
)


def boundaries(counts):
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    return prefix


def covers(slices, total):
    cuts = [a for a, _ in slices] + [slices[-1][1]]
    return cuts[0] == 0 and cuts[-1] == total and all(
        a == pb for (a, _), (_, pb) in zip(slices[1:], slices, strict=False)) and all(
        a <= b for a, b in slices)


def requests_cut(slices, counts):
    """Indices of the requests that some cut separates."""
    prefix = boundaries(counts)
    cut = set()
    for a, _ in slices[1:]:
        for r in range(len(counts)):
            if prefix[r] < a < prefix[r + 1]:
                cut.add(r)
    return cut


# ---- the policies alone --------------------------------------------------------------------

counts_st = st.lists(st.integers(0, 200), min_size=0, max_size=24)


@given(counts_st, st.integers(2, 4), st.sampled_from([0.0, 0.3, SGLANG_TWO_CHUNK_THRESHOLD, 0.5]))
def test_two_chunk_rule(counts, n, threshold):
    got = split_requests_two_chunk(counts, n, threshold)
    total = sum(counts)
    whole = split_requests(counts, n)
    note(f"got={got} whole={whole}")
    if got is None:
        assert whole is None and (threshold == 0 or total < n)
        return
    slices, two_chunk = got
    assert len(slices) == n and covers(slices, total)
    assert all(b > a for a, b in slices), "every ubatch holds a real token"
    if not two_chunk:
        # whole requests, and balanced enough (or no threshold)
        assert slices == whole and not requests_cut(slices, counts)
        assert threshold == 0 or token_balance(slices) >= threshold
    else:
        # the two-chunk cut: even token counts, and only because the boundaries fell short
        assert threshold > 0 and (whole is None or token_balance(whole) < threshold)
        assert slices == split_tokens(total, n)
        if n == 2:
            assert len(requests_cut(slices, counts)) <= 1
        # the balance bound: two-chunk sizes differ by at most one token
        sizes = [b - a for a, b in slices]
        assert max(sizes) - min(sizes) <= 1


def test_two_chunk_examples():
    # SGLang's case: one long prefill beside short ones: the long one is cut at the midpoint
    assert split_requests_two_chunk([1000, 10, 10], 2) == (((0, 510), (510, 1020)), True)
    # balanced enough: whole requests
    assert split_requests_two_chunk([500, 480, 20], 2) == (((0, 500), (500, 1000)), False)
    # a single request can only be split by the two-chunk rule
    assert split_requests_two_chunk([9], 2) == (((0, 5), (5, 9)), True)
    assert split_requests_two_chunk([9], 2, 0.0) is None
    assert token_balance(((0, 4), (4, 10))) == pytest.approx(0.4)
    assert token_balance(((0, 3), (3, 6), (6, 9))) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="threshold"):
        split_requests_two_chunk([1, 1], 2, 0.7)


@given(st.integers(0, 60), st.integers(1, 4), st.integers(1, 5))
def test_split_tokens_with_units_never_cuts_a_unit(units, n, unit):
    slices = split_tokens(units * unit, n, unit=unit)
    assert covers(slices, units * unit)
    assert all(a % unit == 0 for a, _ in slices)
    sizes = [b - a for a, b in slices]
    assert max(sizes) - min(sizes) <= unit and sizes == sorted(sizes, reverse=True)


def test_split_tokens_unit_mismatch():
    with pytest.raises(ValueError, match="multiple of unit"):
        split_tokens(10, 2, unit=3)


def test_split_at():
    assert split_at(10, [3]) == ((0, 3), (3, 10))
    assert split_at(10, [3, 3]) == ((0, 3), (3, 3), (3, 10))
    for bad in ([11], [-1], [5, 4]):
        with pytest.raises(ValueError, match="split_points"):
            split_at(10, bad)


def test_is_uniform_decode():
    assert is_uniform_decode([1, 1, 1])
    assert not is_uniform_decode([1, 2])
    assert is_uniform_decode([3, 3, 0, 3], num_speculative_tokens=2)
    assert not is_uniform_decode([3, 3], num_speculative_tokens=1)
    assert not is_uniform_decode([])


@given(counts_st.filter(lambda c: sum(c) > 0), st.integers(2, 4), st.integers(0, 300))
def test_fill_cuts_fill_each_ubatch_in_turn(counts, n, capacity):
    total = sum(counts)
    slices = fill_cuts(total, capacity, n, request_token_counts=counts)
    need = min_fill_capacity(total, n, request_token_counts=counts)
    note(f"slices={slices} need={need}")
    assert (slices is not None) == (capacity >= need)
    if slices is None:
        return
    assert covers(slices, total) and not requests_cut(slices, counts)
    assert all(b - a <= capacity for a, b in slices)
    prefix = boundaries(counts)
    for a, b in slices[:-1]:
        # greedy: the next request with tokens would not have fitted
        nxt = min((p for p in prefix if p > b), default=None)
        assert nxt is None or nxt - a > capacity
    # vLLM's empty-last-ubatch rule, read off the capacities
    last_ok = max_capacity_with_nonempty_last(total, n, request_token_counts=counts)
    assert (slices[-1][1] > slices[-1][0]) == (capacity <= last_ok)


@given(st.integers(0, 500), st.integers(2, 4), st.integers(1, 4), st.integers(0, 300))
def test_fill_cuts_by_units(units, n, unit, capacity):
    total = units * unit
    slices = fill_cuts(total, capacity, n, unit=unit)
    need = min_fill_capacity(total, n, unit=unit)
    assert (slices is not None) == (capacity >= need)
    if slices is not None:
        assert covers(slices, total) and all(a % unit == 0 for a, _ in slices)
        assert all(b - a <= capacity for a, b in slices)


def test_graph_padded_size():
    sizes = (8, 16, 24, 33, 64)
    assert graph_padded_size(4, 2, sizes) == 8
    assert graph_padded_size(9, 2, sizes) == 24
    assert graph_padded_size(11, 3, sizes) == 33
    assert graph_padded_size(33, 2, sizes) is None
    assert graph_padded_size(5, 2, ()) is None


# ---- whole plans across a simulated group --------------------------------------------------


def simulate(ranks, cfg):
    """Each rank: dict with tokens, counts (or None), decode_only (or None), split_points."""
    decisions = [local_vote(r["tokens"], cfg, request_token_counts=r.get("counts"),
                            decode_only=r.get("decode_only"), split_points=r.get("split_points"))
                 for r in ranks]
    reduced = [max(col) for col in zip(*(encode_vote(d, cfg) for d in decisions), strict=True)]
    return decisions, [resolve_plan(r["tokens"], d, cfg, reduced)
                       for r, d in zip(ranks, decisions, strict=True)]


@st.composite
def rank_st(draw, spec):
    kind = draw(st.sampled_from(["prefill", "decode", "empty"]))
    if kind == "empty":
        return {"tokens": 0, "counts": draw(st.sampled_from([None, [], [0, 0]]))}
    if kind == "decode":
        counts = [1 + spec] * draw(st.integers(1, 40))
    else:
        counts = draw(st.lists(st.integers(0, 120), min_size=1, max_size=12))
    return {"tokens": sum(counts), "counts": counts}


@given(
    data=st.data(),
    n=st.integers(2, 3),
    mode=st.sampled_from(list(SplitMode)),
    spec=st.sampled_from([0, 0, 1, 3]),
    two_chunk=st.sampled_from([0.0, SGLANG_TWO_CHUNK_THRESHOLD]),
    sizes=st.sampled_from([(), (8, 16, 32, 64, 128, 256), (6, 12, 48, 96, 384)]),
    allow_mixed=st.booleans(),
)
def test_group_plans_follow_the_rules(data, n, mode, spec, two_chunk, sizes, allow_mixed):
    ranks = data.draw(st.lists(rank_st(spec), min_size=1, max_size=4))
    cfg = SplitConfig(num_ubatches=n, mode=mode, decode_token_threshold=0, prefill_token_threshold=0,
                      two_chunk_threshold=two_chunk, num_speculative_tokens=spec,
                      cudagraph_sizes=sizes, allow_mixed_kinds=allow_mixed)
    decisions, plans = simulate(ranks, cfg)
    for r, d, p in zip(ranks, decisions, plans, strict=True):
        note(f"{r['counts']} -> {d.vote.name} {d.reason.value} -> {p}")
    # agreement: identical on every rank
    assert len({(p.split, p.padded_size if p.split else None, p.num_ubatches if p.split else None,
                 p.graph_size) for p in plans}) == 1
    for r, d, p in zip(ranks, decisions, plans, strict=True):
        counts, total = r["counts"] or [], r["tokens"]
        assert covers(p.slices, total)  # every token in exactly one ubatch
        if not p.split:
            assert p.slices == ((0, total),)
            continue
        assert p.num_ubatches == n and all(v <= p.padded_size for v in p.valid_rows)
        if total:
            assert all(v > 0 for v in p.valid_rows), "a rank with tokens ran a padding-only ubatch"
        # no request is split except by the two-chunk rule (or plain token cuts)
        cut = requests_cut(p.slices, counts)
        if mode is not SplitMode.TOKENS:
            assert not cut or (p.two_chunk and mode is SplitMode.REQUESTS)
        if is_uniform_decode(counts, spec) and spec:
            assert not cut, "a cut separated a request's draft tokens"
        if p.two_chunk:
            assert max(p.valid_rows) - min(p.valid_rows) <= 1
        elif mode is SplitMode.REQUESTS and two_chunk and total and not d.decode:
            assert token_balance(p.slices) >= two_chunk
        if p.graph_size is not None:
            assert p.graph_size == n * p.padded_size and p.graph_size in sizes
    # the graph size is the smallest captured one that holds every rank's ubatches
    if plans[0].split and sizes:
        need = max(d.rows for d in decisions if d.vote is Vote.YES)
        assert plans[0].graph_size == graph_padded_size(need, n, sizes)
    # mixed kinds do not split unless allowed
    kinds = {d.decode for d in decisions if d.vote is Vote.YES}
    if len(kinds) == 2 and not allow_mixed and all(d.vote is not Vote.NO for d in decisions):
        assert {p.reason for p in plans} == {SplitReason.MIXED_KINDS}


def test_speculative_decode_examples():
    cfg = SplitConfig(num_speculative_tokens=2, decode_token_threshold=4)
    # 5 requests of draft 2 + 1: the cut goes between requests (9 | 6), never at 8
    plan = plan_ubatches(15, cfg, request_token_counts=[3] * 5)
    assert plan.split and plan.slices == ((0, 9), (9, 15)) and plan.padded_size == 9
    plan = plan_ubatches(15, cfg, decode_only=True)  # no counts: cuts at multiples of 3
    assert plan.slices == ((0, 9), (9, 15))
    with pytest.raises(ValueError, match="multiple of unit"):
        plan_ubatches(16, cfg, decode_only=True)
    # one verify request cannot be split
    assert plan_ubatches(3, SplitConfig(num_speculative_tokens=2, decode_token_threshold=0),
                         request_token_counts=[3]).reason is SplitReason.EMPTY_UBATCH
    # declared decode with uneven requests: whole requests, balanced
    plan = plan_ubatches(12, cfg, request_token_counts=[3, 5, 4], decode_only=True)
    assert plan.slices == ((0, 8), (8, 12))
    # the same sizes without speculation count as prefill (threshold 512)
    assert plan_ubatches(15, SplitConfig(decode_token_threshold=4),
                         request_token_counts=[3] * 5).reason is SplitReason.BELOW_THRESHOLD


def test_cudagraph_padding_examples():
    cfg = SplitConfig(prefill_token_threshold=0, cudagraph_sizes=(16, 32, 64))
    plan = plan_ubatches(20, cfg)  # 10 + 10 real rows; whole batch padded to 32
    assert (plan.graph_size, plan.padded_size) == (32, 16)
    assert plan.valid_rows == (10, 10) and plan.padding_rows == (6, 6)
    # too big for any graph: eager, padded only to the larger ubatch
    plan = plan_ubatches(130, cfg)
    assert plan.graph_size is None and plan.padded_size == 65
    # FILL aims at the padded count: 20 tokens fill the first 16-row ubatch, padding at the end
    fill = SplitConfig(mode="fill", prefill_token_threshold=0, cudagraph_sizes=(8, 32, 64))
    plan = plan_ubatches(20, fill)
    assert plan.slices == ((0, 16), (16, 20)) and plan.padding_rows == (0, 12) and plan.graph_size == 32
    # request-aligned fill: whole requests up to 16 rows each
    plan = plan_ubatches(20, fill, request_token_counts=[6, 6, 6, 2])
    assert plan.slices == ((0, 12), (12, 20)) and plan.padded_size == 16
    # vLLM's empty-last-ubatch rule: at 32 rows per ubatch, 20 tokens leave the last empty
    wide = SplitConfig(mode="fill", prefill_token_threshold=0, cudagraph_sizes=(64,))
    plan = plan_ubatches(20, wide)
    assert not plan.split and plan.reason is SplitReason.EMPTY_UBATCH


def test_fill_empty_last_ubatch_in_a_group():
    """A rank whose own batch fills both ubatches, but not at the size another rank needs."""
    cfg = SplitConfig(mode="fill", prefill_token_threshold=0)
    _, plans = simulate([{"tokens": 100}, {"tokens": 30}], cfg)
    # the group's ubatch size is 50; rank 1's 30 tokens fill the first ubatch only
    assert [p.reason for p in plans] == [SplitReason.EMPTY_UBATCH] * 2
    _, plans = simulate([{"tokens": 100}, {"tokens": 60}], cfg)
    assert plans[1].slices == ((0, 50), (50, 60)) and plans[0].padded_size == plans[1].padded_size == 50
    # a rank with no tokens does not count: it abstains and pads
    _, plans = simulate([{"tokens": 100}, {"tokens": 0}], cfg)
    assert plans[1].split and plans[1].slices == ((0, 0), (0, 0))


def test_caller_split_points():
    cfg = SplitConfig(prefill_token_threshold=0)
    plan = plan_ubatches(10, cfg, split_points=[7])
    assert plan.slices == ((0, 7), (7, 10)) and plan.padded_size == 7
    # an engine's point that leaves a ubatch empty does not split
    assert plan_ubatches(10, cfg, split_points=[10]).reason is SplitReason.EMPTY_UBATCH
    with pytest.raises(ValueError, match="split_points needs 1"):
        plan_ubatches(10, cfg, split_points=[3, 4])
    # the points replace FILL's cuts too, and pad as any other plan
    _, plans = simulate([{"tokens": 10, "split_points": [2]}, {"tokens": 10}],
                        SplitConfig(mode="fill", prefill_token_threshold=0))
    assert plans[0].slices == ((0, 2), (2, 10)) and plans[0].padded_size == 8


def test_mixed_kinds_examples():
    decode = {"tokens": 64, "counts": [1] * 64}
    prefill = {"tokens": 600, "counts": [300, 300]}
    _, plans = simulate([decode, prefill], SplitConfig())
    assert [p.reason for p in plans] == [SplitReason.MIXED_KINDS] * 2
    _, plans = simulate([decode, prefill, {"tokens": 0}], SplitConfig(allow_mixed_kinds=True))
    assert all(p.split for p in plans) and plans[0].padded_size == 300
    # a zero-token rank has no kind: it goes along with either
    _, plans = simulate([decode, {"tokens": 0}], SplitConfig())
    assert all(p.split for p in plans)


def test_requests_mode_zero_token_request_never_gives_an_empty_ubatch():
    cfg = SplitConfig(mode="requests", prefill_token_threshold=0)
    plan = plan_ubatches(5, cfg, request_token_counts=[0, 5])
    assert not plan.split and plan.reason is SplitReason.TOO_FEW_REQUESTS
    plan = plan_ubatches(8, cfg, request_token_counts=[0, 0, 5, 0, 3])
    assert plan.slices == ((0, 5), (5, 8))


def test_config_mismatch_raises():
    a = SplitConfig(prefill_token_threshold=0)
    b = SplitConfig(prefill_token_threshold=0, cudagraph_sizes=(64,))
    da, db = local_vote(10, a), local_vote(10, b)
    reduced = [max(x, y) for x, y in zip(encode_vote(da, a), encode_vote(db, b), strict=True)]
    with pytest.raises(ValueError, match="SplitConfig differs"):
        resolve_plan(10, da, a, reduced)


@given(st.integers(1, 64), st.integers(2, 3))
def test_plan_str_names_graph_and_two_chunk(tokens, n):
    assume(tokens >= n)
    plan = plan_ubatches(tokens, SplitConfig(num_ubatches=n, prefill_token_threshold=0,
                                             cudagraph_sizes=(n * 64,)))
    assert isinstance(plan, UBatchPlan) and f"graph {n * 64}" in str(plan)
