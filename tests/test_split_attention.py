"""dbo.split.attention: each ubatch's attention metadata when cuts split requests. The numerical
check runs causal attention over each request's KV cache (context + this step's tokens) as
overlapped ubatches under run_ubatches (each ubatch writes its keys, yields, then attends) and
compares the concatenated outputs with attention over the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import dbo
from dbo.split import SplitConfig, plan_ubatches
from dbo.split.attention import RequestPart, UBatchAttention, split_attention_metadata

H, D = 2, 8


def test_worked_example():
    meta = split_attention_metadata([4, 6, 2], [10, 0, 5], [(0, 6), (6, 12)])
    a, b = meta
    assert a.request_ids == (0, 1) and a.query_start_loc == (0, 4, 6) and a.query_offsets == (0, 0)
    assert a.context_lens == (10, 0) and a.seq_lens == (14, 2)
    assert a.parts == (RequestPart.WHOLE, RequestPart.FIRST)
    # request 1's second part attends to its first part's two tokens
    assert b.request_ids == (1, 2) and b.query_start_loc == (0, 4, 6) and b.query_offsets == (2, 0)
    assert b.context_lens == (2, 5) and b.seq_lens == (6, 7)
    assert b.parts == (RequestPart.LAST, RequestPart.WHOLE)
    assert (b.max_query_len, b.max_seq_len, b.query_lens) == (4, 7, (4, 2))
    t = b.tensors()
    assert t["query_start_loc"].dtype == torch.int32 and t["query_start_loc"].shape == (3,)
    assert t["seq_lens"].tolist() == [6, 7] and t["request_ids"].tolist() == [1, 2]


def test_request_cut_in_three_and_empty_requests():
    meta = split_attention_metadata([0, 9, 0], [1, 1, 1], [(0, 3), (3, 6), (6, 9)])
    assert [m.parts for m in meta] == [(RequestPart.FIRST,), (RequestPart.MIDDLE,), (RequestPart.LAST,)]
    assert [m.request_ids for m in meta] == [(1,), (1,), (1,)]  # zero-query requests appear nowhere
    assert [m.context_lens for m in meta] == [(1,), (4,), (7,)]


def test_plan_input_states_padding():
    plan = plan_ubatches(10, SplitConfig(prefill_token_threshold=0, cudagraph_sizes=(16,)),
                         request_token_counts=[7, 3])
    meta = split_attention_metadata([7, 3], [0, 0], plan)
    assert [m.num_padding for m in meta] == [3, 3] and [m.token_slice for m in meta] == [(0, 5), (5, 10)]
    plain = plan_ubatches(10, SplitConfig(enabled=False))
    (only,) = split_attention_metadata([7, 3], [0, 0], plain)
    assert only.parts == (RequestPart.WHOLE, RequestPart.WHOLE) and only.num_padding == 0


@pytest.mark.parametrize("args, match", [
    (([1, 2], [0], [(0, 3)]), "context_lens"),
    (([1, -2], [0, 0], [(0, 3)]), ">= 0"),
    (([1, 2], [0, 0], [(0, 2)]), "do not cover"),
    (([1, 2], [0, 0], [(0, 2), (1, 3)]), "do not cover"),
    (([1, 2], [0, 0], []), "do not cover"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        split_attention_metadata(*args)


# ---- numerics: overlapped ubatches == the whole batch --------------------------------------


def make_batch(query_lens, context_lens, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lens), H, D, generator=g, dtype=torch.float64)
    # each request's keys/values: its context (already cached) then this step's tokens
    kv = [(torch.randn(c + n, H, D, generator=g, dtype=torch.float64),
           torch.randn(c + n, H, D, generator=g, dtype=torch.float64))
          for n, c in zip(query_lens, context_lens, strict=True)]
    return q, kv


def causal(q, k, v, first_pos):
    """``q [n, H, D]`` at positions ``first_pos..`` over keys ``k, v [S, H, D]`` at 0..S-1."""
    pos = first_pos + torch.arange(q.shape[0]).unsqueeze(1)
    mask = torch.arange(k.shape[0]).unsqueeze(0) <= pos
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)
    return out.transpose(0, 1)


def whole_batch(q, kv, query_lens, context_lens):
    out, row = [], 0
    for (k, v), n, c in zip(kv, query_lens, context_lens, strict=True):
        out.append(causal(q[row:row + n], k, v, c))
        row += n
    return torch.cat(out) if out else q.new_zeros(0, H, D)


def ubatch_attention(meta: UBatchAttention, q, kv, context_lens, cache, padded_size):
    """One ubatch: write this step's keys of its requests into the cache, yield, attend."""
    a, b = meta.token_slice
    for r, off, n in zip(meta.request_ids, meta.query_offsets, meta.query_lens, strict=True):
        lo, hi = context_lens[r] + off, context_lens[r] + off + n
        cache[r][0][lo:hi] = kv[r][0][lo:hi]
        cache[r][1][lo:hi] = kv[r][1][lo:hi]
    dbo.dbo_yield()  # the other ubatches run in between, as at an all-to-all
    out = q.new_zeros(padded_size, H, D)
    for j, r in enumerate(meta.request_ids):
        s, e = meta.query_start_loc[j], meta.query_start_loc[j + 1]
        k, v = cache[r][0][: meta.seq_lens[j]], cache[r][1][: meta.seq_lens[j]]
        out[s:e] = causal(q[a + s:a + e], k, v, meta.context_lens[j])
    return out


def overlapped(q, kv, query_lens, context_lens, plan, *, metadata=None):
    metadata = metadata or split_attention_metadata(query_lens, context_lens, plan)
    # the KV cache: context filled, this step's rows NaN until a ubatch writes them, so a read
    # before the write (or past seq_lens) poisons the output
    cache = []
    for (k, v), c in zip(kv, context_lens, strict=True):
        kc, vc = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        kc[:c], vc[:c] = k[:c], v[:c]
        cache.append((kc, vc))
    fns = [lambda m=m: ubatch_attention(m, q, kv, context_lens, cache, plan.padded_size)
           for m in metadata]
    outs = dbo.run_ubatches(fns, token_offsets=plan.token_offsets) if plan.split else [fns[0]()]
    return torch.cat([o[: plan.num_valid(i)] for i, o in enumerate(outs)])


@given(
    reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 10)), min_size=1, max_size=8),
    n=st.integers(2, 3),
    mode=st.sampled_from(["tokens", "requests", "fill"]),
    sizes=st.sampled_from([(), (16, 32, 64, 96)]),
    seed=st.integers(0, 2**16),
)
def test_ubatches_equal_the_whole_batch(reqs, n, mode, sizes, seed):
    query_lens = [a for a, _ in reqs]
    context_lens = [c for _, c in reqs]
    total = sum(query_lens)
    cfg = SplitConfig(num_ubatches=n, mode=mode, prefill_token_threshold=0, decode_token_threshold=0,
                      two_chunk_threshold=0.48, cudagraph_sizes=sizes)
    plan = plan_ubatches(total, cfg, request_token_counts=query_lens)
    note(f"plan={plan}")
    q, kv = make_batch(query_lens, context_lens, seed)
    ref = whole_batch(q, kv, query_lens, context_lens)
    out = overlapped(q, kv, query_lens, context_lens, plan)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_split_request_needs_the_grown_context():
    """The check can fail: a split request's second part that ignores its first part's keys
    (context not grown) gives different numbers."""
    query_lens, context_lens = [10, 4], [3, 0]
    plan = plan_ubatches(14, SplitConfig(prefill_token_threshold=0), request_token_counts=query_lens)
    assert plan.split and plan.slices == ((0, 7), (7, 14))
    q, kv = make_batch(query_lens, context_lens, 0)
    ref = whole_batch(q, kv, query_lens, context_lens)
    torch.testing.assert_close(overlapped(q, kv, query_lens, context_lens, plan), ref)
    good = split_attention_metadata(query_lens, context_lens, plan)
    # pretend request 0's tail is a request of its own: context 3 instead of 3 + 7
    tail = good[1]
    bad = UBatchAttention(tail.ubatch, tail.token_slice, tail.num_padding, tail.request_ids,
                          tail.query_start_loc, tail.query_offsets, (3, 0),
                          (6, tail.seq_lens[1]), tail.parts)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(overlapped(q, kv, query_lens, context_lens, plan,
                                              metadata=(good[0], bad)), ref)
