"""Where to cut one rank's batch: the split policies, as pure functions of Python ints.

Every policy returns ``(start, stop)`` token rows per ubatch, contiguous and in order, covering
``0..num_tokens``; none issues a collective or reads a tensor. :mod:`dbo.split` picks one per
batch from :class:`~dbo.split.SplitConfig` and makes the ranks of a group agree.

The rules (the mapping to vLLM's and SGLang's knobs is in ``docs/splitting.md``):

- :func:`split_tokens`: even token counts, larger ubatches first; with ``unit > 1`` (speculative
  decoding: each request carries ``unit`` tokens, draft + 1) the cuts fall on multiples of
  ``unit``, so no request's draft tokens are separated.
- :func:`split_requests`: cuts at request boundaries, balanced by token count; every ubatch gets
  at least one token (a zero-token request never makes a ubatch on its own).
- :func:`split_requests_two_chunk`: the same, unless the best boundaries leave the ubatches too
  unequal (:func:`token_balance` below a threshold; SGLang uses 0.48), in which case the cuts go
  at even token counts and cut a request in two ("two-chunk").
- :func:`split_at`: the caller's own cut points.
- :func:`fill_cuts`: request-aligned (or ``unit``-aligned) cuts that fill each ubatch up to a
  capacity (the padded ubatch size of a CUDA graph), so the real tokens come first and the
  padding gathers in the last ubatches, as vLLM and SGLang place it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Slice",
    "split_tokens",
    "split_requests",
    "split_requests_two_chunk",
    "split_at",
    "token_balance",
    "is_uniform_decode",
    "fill_cuts",
    "min_fill_capacity",
    "max_capacity_with_nonempty_last",
    "SGLANG_TWO_CHUNK_THRESHOLD",
]

Slice = tuple[int, int]

#: SGLang's default ``tbo_token_distribution_threshold``
SGLANG_TWO_CHUNK_THRESHOLD = 0.48


def _check_counts(request_token_counts: Sequence[int]) -> list[int]:
    counts = [int(c) for c in request_token_counts]
    if any(c < 0 for c in counts):
        raise ValueError("request_token_counts must be >= 0")
    return counts


def _prefix(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _slices(cuts: Sequence[int]) -> tuple[Slice, ...]:
    return tuple(zip(cuts, cuts[1:], strict=False))


def split_tokens(num_tokens: int, num_ubatches: int, *, unit: int = 1) -> tuple[Slice, ...]:
    """Cut ``num_tokens`` rows into ``num_ubatches`` contiguous slices of even size (sizes differ
    by at most ``unit``; larger ones first), every cut at a multiple of ``unit``. Slices may be
    empty when there are fewer units than ubatches.

    Raises:
        ValueError: negative counts, ``num_ubatches < 1``, ``unit < 1``, or ``num_tokens`` not a
            multiple of ``unit``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    if unit < 1 or num_tokens % unit:
        raise ValueError(f"num_tokens={num_tokens} must be a multiple of unit={unit} >= 1")
    base, extra = divmod(num_tokens // unit, num_ubatches)
    cuts = [0]
    for i in range(num_ubatches):
        cuts.append(cuts[-1] + (base + (1 if i < extra else 0)) * unit)
    return _slices(cuts)


def split_requests(request_token_counts: Sequence[int], num_ubatches: int) -> tuple[Slice, ...] | None:
    """Cut at request boundaries into ``num_ubatches`` slices of whole requests, balanced by
    token count; None when fewer than ``num_ubatches`` requests have tokens.

    Cut ``j`` goes to the request boundary nearest ``j * total / num_ubatches`` that keeps at
    least one token in every ubatch (ties go to the earlier boundary). For two ubatches this
    minimises the larger ubatch, hence the padded size. A zero-token request sits at a boundary
    and belongs to no ubatch's rows.

    Args:
        request_token_counts: tokens of each request, in batch order (ints >= 0).
    Returns:
        ``(start, stop)`` token rows of each ubatch.
    """
    counts = _check_counts(request_token_counts)
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    total = sum(counts)
    # the distinct token positions where a cut may go: inner boundaries between requests
    bounds = sorted(set(_prefix(counts)[1:-1]) - {0, total})
    if len(bounds) < num_ubatches - 1:
        return None
    cuts, last = [0], -1  # last: index into bounds of the previous cut
    for j in range(1, num_ubatches):
        lo, hi = last + 1, len(bounds) - (num_ubatches - j)
        target = j * total / num_ubatches
        last = min(range(lo, hi + 1), key=lambda k: (abs(bounds[k] - target), k))
        cuts.append(bounds[last])
    cuts.append(total)
    return _slices(cuts)


def token_balance(slices: Sequence[Slice]) -> float:
    """How even the ubatches are: the smallest ubatch's share of the tokens times
    ``num_ubatches / 2``, so that an even split scores 0.5 for any number of ubatches. For two
    ubatches it is SGLang's measure (the smaller half's share of the tokens). 0.0 for no tokens.
    """
    sizes = [b - a for a, b in slices]
    total = sum(sizes)
    return 0.0 if total == 0 else min(sizes) * len(sizes) / (2 * total)


def split_requests_two_chunk(request_token_counts: Sequence[int], num_ubatches: int,
                             threshold: float = SGLANG_TWO_CHUNK_THRESHOLD,
                             ) -> tuple[tuple[Slice, ...], bool] | None:
    """Request-boundary cuts (:func:`split_requests`), or even token cuts that cut requests
    ("two-chunk") when the boundary cuts are missing or score a :func:`token_balance` below
    ``threshold``.

    With two ubatches the two-chunk cut splits exactly one request at the token midpoint (the
    larger half first); with more ubatches each cut may split a request. ``threshold=0`` never
    cuts a request.

    Returns:
        ``(slices, two_chunk)``, or None when neither rule gives every ubatch a token.
    Raises:
        ValueError: ``threshold`` outside ``[0, 0.5]``, or a negative count.
    """
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"threshold must be in [0, 0.5], got {threshold!r}")
    counts = _check_counts(request_token_counts)
    slices = split_requests(counts, num_ubatches)
    if slices is not None and token_balance(slices) >= threshold:
        return slices, False
    total = sum(counts)
    if threshold > 0 and total >= num_ubatches:
        return split_tokens(total, num_ubatches), True
    return None if slices is None else (slices, False)


def split_at(num_tokens: int, split_points: Sequence[int]) -> tuple[Slice, ...]:
    """The caller's cut points: ``split_points`` (non-decreasing token rows in
    ``0..num_tokens``) give ``len(split_points) + 1`` ubatches.

    Raises:
        ValueError: points out of range or out of order.
    """
    points = [int(p) for p in split_points]
    cuts = [0, *points, num_tokens]
    if any(a > b for a, b in zip(cuts, cuts[1:], strict=False)):
        raise ValueError(f"split_points must be non-decreasing rows in 0..{num_tokens}, got {points}")
    return _slices(cuts)


def is_uniform_decode(request_token_counts: Sequence[int], num_speculative_tokens: int = 0) -> bool:
    """True when every request that has tokens carries exactly ``1 + num_speculative_tokens``
    (a decode step; with speculative decoding, the draft tokens plus one), and one does."""
    counts = _check_counts(request_token_counts)
    live = [c for c in counts if c]
    return bool(live) and all(c == 1 + num_speculative_tokens for c in live)


def fill_cuts(num_tokens: int, capacity: int, num_ubatches: int, *,
              request_token_counts: Sequence[int] | None = None, unit: int = 1,
              ) -> tuple[Slice, ...] | None:
    """Fill each ubatch in turn with as many whole requests (or ``unit``-token pieces when no
    counts are given) as fit in ``capacity`` rows; the later ubatches take what is left, the
    last ones possibly nothing. None when the batch does not fit in ``num_ubatches *
    capacity`` rows this way (a request longer than ``capacity``, or too many tokens).

    This is the cut that aims at the padded token count: with ``capacity`` the ubatch size of a
    captured CUDA graph, the real rows come first and the padding gathers at the end, as in
    vLLM (cut at half the padded count) and SGLang (split index on the padded batch).
    """
    if capacity < 0 or num_ubatches < 1:
        raise ValueError(f"capacity must be >= 0 and num_ubatches >= 1, got {capacity}, {num_ubatches}")
    if request_token_counts is None:
        if unit < 1 or num_tokens % unit:
            raise ValueError(f"num_tokens={num_tokens} must be a multiple of unit={unit} >= 1")
        step = capacity // unit * unit
        cuts = [min(j * step, num_tokens) for j in range(num_ubatches)] + [num_tokens]
        return _slices(cuts) if num_ubatches * step >= num_tokens else None
    prefix = _prefix(_check_counts(request_token_counts))
    if prefix[-1] != num_tokens:
        raise ValueError(f"request_token_counts sum to {prefix[-1]}, not num_tokens={num_tokens}")
    cuts, k = [0], 0  # k: requests placed so far
    for _ in range(num_ubatches - 1):
        while k < len(prefix) - 1 and prefix[k + 1] <= cuts[-1] + capacity:
            k += 1
        cuts.append(prefix[k])
    cuts.append(num_tokens)
    return _slices(cuts) if num_tokens - cuts[-2] <= capacity else None


def min_fill_capacity(num_tokens: int, num_ubatches: int, *,
                      request_token_counts: Sequence[int] | None = None, unit: int = 1) -> int:
    """The smallest capacity at which :func:`fill_cuts` fits the batch (0 for no tokens)."""
    if request_token_counts is None:
        units = -(-num_tokens // unit)
        return -(-units // num_ubatches) * unit
    lo = max([0, *(int(c) for c in request_token_counts)])
    hi = max(lo, num_tokens)
    while lo < hi:  # fill_cuts fits for every capacity from the answer on
        mid = (lo + hi) // 2
        if fill_cuts(num_tokens, mid, num_ubatches, request_token_counts=request_token_counts) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def max_capacity_with_nonempty_last(num_tokens: int, num_ubatches: int, *,
                                    request_token_counts: Sequence[int] | None = None,
                                    unit: int = 1) -> int:
    """The largest capacity at which :func:`fill_cuts` still leaves a real token in the last
    ubatch; -1 when none does (too few requests or tokens). Larger capacities move every cut
    later, so the last ubatch stays empty from there on: vLLM's "empty last ubatch" rule."""
    if num_tokens == 0 or num_ubatches < 2:
        return -1 if num_tokens == 0 else num_tokens

    def nonempty(capacity: int) -> bool:
        s = fill_cuts(num_tokens, capacity, num_ubatches, request_token_counts=request_token_counts,
                      unit=unit)
        return s is not None and s[-1][0] < num_tokens

    lo = min_fill_capacity(num_tokens, num_ubatches, request_token_counts=request_token_counts,
                           unit=unit)
    if not nonempty(lo):
        return -1
    hi = num_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if nonempty(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
