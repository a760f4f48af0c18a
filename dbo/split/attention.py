"""Attention metadata per ubatch, for batches whose cuts may split a request in two.

A split plan's cuts are token rows. An attention backend needs, per ubatch, the requests whose
query tokens it holds, where each one's queries start, and how many keys each one attends to.
When a cut splits a request (the two-chunk rule, token cuts, caller points), the request's
later part attends to the keys of its earlier part: its context grows by the rows the earlier
ubatches hold, exactly as if the earlier part had been a previous chunk of a chunked prefill.
:func:`split_attention_metadata` works that out from per-request query and context lengths.

Ordering this relies on: the later part reads the KV-cache rows the earlier part writes in the
same layer. Under :func:`dbo.run_ubatches` ubatch ``i`` reaches each layer's attention before
ubatch ``i + 1`` does, on the same compute stream, so those rows are written first.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dbo.split.policies import Slice
from dbo.split.types import UBatchPlan

__all__ = ["RequestPart", "UBatchAttention", "split_attention_metadata"]


class RequestPart(str, enum.Enum):
    """Which part of a request's query tokens a ubatch holds."""

    WHOLE = "whole"  #: all of them
    FIRST = "first"  #: the first part of a request cut by a later ubatch boundary
    MIDDLE = "middle"  #: neither end (a request cut into three or more)
    LAST = "last"  #: the last part; earlier ubatches hold the rest


@dataclass(frozen=True)
class UBatchAttention:
    """One ubatch's attention metadata. Per-request fields have one entry per request in
    ``request_ids`` (the requests with query rows in this ubatch, in batch order).

    Attributes:
        ubatch: the ubatch's index.
        token_slice: ``(start, stop)`` rows of the parent batch this ubatch holds.
        num_padding: padding rows after the real ones (not part of any request).
        request_ids: indices of the requests in the parent batch.
        query_start_loc: ``len(request_ids) + 1`` cumulative query offsets within the ubatch,
            from 0 to the ubatch's real rows (vLLM's ``query_start_loc``, SGLang's
            ``extend_start_loc`` plus the end).
        query_offsets: each request's first query token here, counted from the request's first
            query token of this step.
        context_lens: keys each request's first query here follows: its context before the
            step plus the query tokens earlier ubatches hold (SGLang's ``extend_prefix_lens``).
        seq_lens: keys each request attends to at its last query here
            (``context_lens + query lens``).
        parts: :class:`RequestPart` of each request.
    """

    ubatch: int
    token_slice: Slice
    num_padding: int
    request_ids: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    query_offsets: tuple[int, ...]
    context_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    parts: tuple[RequestPart, ...]

    @property
    def query_lens(self) -> tuple[int, ...]:
        q = self.query_start_loc
        return tuple(b - a for a, b in zip(q, q[1:], strict=False))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    def tensors(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """``query_start_loc`` (``int32[R + 1]``), ``seq_lens``, ``context_lens`` and
        ``request_ids`` (``int32[R]``) on ``device``, R = ``len(request_ids)``."""
        names = ("query_start_loc", "seq_lens", "context_lens", "request_ids")
        return {k: torch.tensor(getattr(self, k), dtype=torch.int32, device=device) for k in names}


def _part(first: bool, last: bool) -> RequestPart:
    if first and last:
        return RequestPart.WHOLE
    return RequestPart.FIRST if first else RequestPart.LAST if last else RequestPart.MIDDLE


def split_attention_metadata(query_lens: Sequence[int], context_lens: Sequence[int],
                             plan: UBatchPlan | Sequence[Slice]) -> tuple[UBatchAttention, ...]:
    """Each ubatch's per-request attention metadata.

    Args:
        query_lens: query tokens of each request in this step, in batch order (ints >= 0);
            they sum to the batch's rows.
        context_lens: tokens of each request already in the KV cache before this step.
        plan: a :class:`~dbo.split.UBatchPlan` (one ubatch when it does not split) or the
            ``(start, stop)`` row slices themselves.
    Returns:
        One :class:`UBatchAttention` per ubatch. A request with no query tokens appears in none.
    Raises:
        ValueError: lengths of different counts, negative lengths, or slices that do not cover
            the batch's rows in order.
    """
    q = [int(x) for x in query_lens]
    ctx = [int(x) for x in context_lens]
    if len(q) != len(ctx):
        raise ValueError(f"{len(q)} query_lens but {len(ctx)} context_lens")
    if any(x < 0 for x in q + ctx):
        raise ValueError("query_lens and context_lens must be >= 0")
    slices = tuple(plan.slices) if isinstance(plan, UBatchPlan) else tuple(tuple(s) for s in plan)
    padded = plan.padded_size if isinstance(plan, UBatchPlan) else None
    total = sum(q)
    cuts = [a for a, _ in slices] + [slices[-1][1]] if slices else []
    if not slices or cuts[0] != 0 or cuts[-1] != total or any(
            a != b_prev for (a, _), (_, b_prev) in zip(slices[1:], slices, strict=False)) or any(
            a > b for a, b in slices):
        raise ValueError(f"slices {list(slices)} do not cover the {total} query rows in order")
    starts = [0]
    for x in q:
        starts.append(starts[-1] + x)
    out = []
    for i, (a, b) in enumerate(slices):
        ids, loc, offs, cls, sls, parts = [], [0], [], [], [], []
        for r, (s, e) in enumerate(zip(starts, starts[1:], strict=False)):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            ids.append(r)
            loc.append(loc[-1] + hi - lo)
            offs.append(lo - s)
            cls.append(ctx[r] + lo - s)
            sls.append(ctx[r] + hi - s)
            parts.append(_part(lo == s, hi == e))
        pad = 0 if padded is None else padded - (b - a)
        out.append(UBatchAttention(i, (a, b), pad, tuple(ids), tuple(loc), tuple(offs),
                                   tuple(cls), tuple(sls), tuple(parts)))
    return tuple(out)
