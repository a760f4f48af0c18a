"""Where to cut a batch into ubatches, and whether every rank of a group agrees to.

Three separate passes, the first two pure:

1. :func:`local_vote` picks this rank's cut points with one of the policies of
   :mod:`dbo.split.policies` (even token counts; request boundaries balanced by tokens, with the
   "two-chunk" fallback; the caller's own points; or filling each ubatch up to the padded size),
   applies the off switches and the thresholds, and says whether this rank wants to split.
2. :func:`resolve_plan` turns the group's reduced votes into this rank's :class:`UBatchPlan`.
3. :func:`plan_ubatches` runs both with one ``all_reduce`` (op MAX, ten int64) in between, so
   every rank of the group splits or none does, and when they split they all run the same
   number of ubatches of the same padded size: the all-to-all collectives inside the model are
   then issued in the same order, with the same shapes, everywhere. A rank with fewer tokens
   pads; a rank with no tokens abstains from the vote and pads every ubatch.

The group does not split when any rank votes no, when a rank with tokens would run a ubatch of
padding only (vLLM's empty-last-ubatch rule), or when the voting ranks run batches of different
kinds (decode on one, prefill on another) and ``SplitConfig.allow_mixed_kinds`` is False.

Padding rows sit at the end of each ubatch (rows ``num_valid(i):padded_size``); they must route
to no expert (:func:`mask_padding_routing` gives them ``topk_ids = -1`` and weight 0) and their
outputs are dropped on merge. With ``SplitConfig.cudagraph_sizes`` the whole batch pads to the
smallest captured size that holds it (``UBatchPlan.graph_size``), each ubatch to an equal share.

Thresholds (defaults as vLLM's ``dbo_decode_token_threshold`` / ``dbo_prefill_token_threshold``):
a decode-only batch is split from 32 tokens on, a batch with any prefill from 512. Below that
each half is too small for its matmuls to run efficiently and the all-to-all is latency-bound,
so overlapping costs more (extra launches, padding, a yield per layer) than it hides.

The environment variable ``DBO_DISABLE`` (``1``/``true``/``yes``/``on``) switches splitting
off for the whole process, as does ``SplitConfig(enabled=False)``. A disabled rank still takes
part in the vote (it votes no), so a switch set on some ranks only cannot desynchronise the
group's collectives; it costs that one small all-reduce. See ``docs/splitting.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.errors import DeviceMemoryError
from dbo.expert_schedule import ExpertSchedule, parse_expert_schedule
from dbo.peers.collectives import all_reduce_max, group_rank, group_size
from dbo.split.log import FALLBACK_LOG
from dbo.split.padding import graph_padded_size
from dbo.split.policies import (
    Slice,
    fill_cuts,
    is_uniform_decode,
    max_capacity_with_nonempty_last,
    min_fill_capacity,
    split_at,
    split_requests,
    split_requests_two_chunk,
    split_tokens,
)
from dbo.split.types import NEVER_SPLIT, SplitConfig, SplitMode, SplitReason, UBatchPlan, Vote

__all__ = [
    "DISABLE_ENV_VAR",
    "LocalDecision",
    "local_vote",
    "encode_vote",
    "encode_room",
    "check_room",
    "resolve_plan",
    "plan_ubatches",
    "free_device_bytes",
    "no_split_plan",
    "dbo_disabled_by_env",
]

#: set to 1/true/yes/on to run every forward plainly (read at each decision)
DISABLE_ENV_VAR = "DBO_DISABLE"


# ---- pass 1 and 2: one rank's vote, and its resolution -------------------------------------


def dbo_disabled_by_env() -> bool:
    """True when the ``DBO_DISABLE`` environment variable switches splitting off."""
    return os.environ.get(DISABLE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class LocalDecision:
    """One rank's vote, its cut points (for YES and ABSTAIN) and the reason behind a NO.

    ``rows`` is the padded ubatch size this rank needs; ``decode`` the kind of its batch.
    In FILL mode (``refill`` set) the cuts are redone at the group's padded size, and
    ``max_fill`` is the largest padded size that still leaves a real row in the last ubatch.
    """

    vote: Vote
    slices: tuple[Slice, ...]
    reason: SplitReason
    detail: str
    rows: int = 0
    decode: bool = False
    two_chunk: bool = False
    refill: tuple[tuple[int, ...] | None, int] | None = None  # (request counts, unit)
    max_fill: int = NEVER_SPLIT


def _no(reason: SplitReason, detail: str) -> LocalDecision:
    return LocalDecision(Vote.NO, (), reason, detail)


def local_vote(
    num_tokens: int,
    config: SplitConfig,
    *,
    request_token_counts: Sequence[int] | None = None,
    decode_only: bool | None = None,
    split_points: Sequence[int] | None = None,
) -> LocalDecision:
    """This rank's wish and cut points, before agreement. Pure; no collective, no host sync.

    ``decode_only=None`` infers it from ``request_token_counts`` (every request carries
    ``1 + config.num_speculative_tokens`` tokens); with no counts the batch counts as mixed
    (the larger threshold applies). ``split_points`` (``num_ubatches - 1`` rows) replace the
    mode's cuts; the thresholds and the group's agreement still apply.
    """
    counts = None if request_token_counts is None else tuple(int(c) for c in request_token_counts)
    if counts is not None and sum(counts) != num_tokens:
        raise ValueError(f"request_token_counts sum to {sum(counts)}, not num_tokens={num_tokens}")
    n = config.num_ubatches
    if split_points is not None and len(split_points) != n - 1:
        raise ValueError(f"split_points needs {n - 1} points for {n} ubatches, got {list(split_points)}")
    if not config.enabled or dbo_disabled_by_env():
        return _no(SplitReason.DISABLED,
                   "SplitConfig(enabled=False)" if not config.enabled else f"{DISABLE_ENV_VAR} is set")
    if not config.expert_schedule.splits:
        return _no(SplitReason.DISABLED, f"SplitConfig(expert_schedule='{config.expert_schedule}')")
    if num_tokens == 0:
        return LocalDecision(Vote.ABSTAIN, ((0, 0),) * n, SplitReason.EMPTY, "no tokens on any rank")
    if decode_only is None:
        decode_only = counts is not None and is_uniform_decode(counts, config.num_speculative_tokens)
    threshold = config.threshold(decode_only)
    if num_tokens < threshold:
        kind = "decode" if decode_only else "prefill/mixed"
        return _no(SplitReason.BELOW_THRESHOLD, f"{num_tokens} tokens < {kind} threshold {threshold}")
    # a speculative decode step's requests are draft + 1 tokens each, never to be separated
    spec = config.num_speculative_tokens
    uniform = counts is None or is_uniform_decode(counts, spec)
    unit = 1 + spec if decode_only and uniform else 1
    two_chunk, refill, max_fill = False, None, NEVER_SPLIT
    if split_points is not None:
        slices = split_at(num_tokens, split_points)
    elif config.mode is SplitMode.FILL:
        refill = (counts, unit)
        rows = min_fill_capacity(num_tokens, n, request_token_counts=counts, unit=unit)
        slices = fill_cuts(num_tokens, rows, n, request_token_counts=counts, unit=unit)
        max_fill = max_capacity_with_nonempty_last(num_tokens, n, request_token_counts=counts, unit=unit)
    elif config.mode is SplitMode.REQUESTS:
        if counts is None:
            raise ValueError("SplitMode.REQUESTS needs request_token_counts")
        threshold = 0.0 if decode_only else config.two_chunk_threshold
        found = split_requests_two_chunk(counts, n, threshold)
        if found is None:
            return _no(SplitReason.TOO_FEW_REQUESTS,
                       f"{sum(1 for c in counts if c)} requests with tokens < {n} ubatches")
        slices, two_chunk = found
    elif decode_only and spec and not uniform:  # declared decode, uneven requests: keep them whole
        found = split_requests(counts, n)
        if found is None:
            return _no(SplitReason.TOO_FEW_REQUESTS, f"{len(counts)} decode requests < {n} ubatches")
        slices = found
    else:
        slices = split_tokens(num_tokens, n, unit=unit)
    if any(a == b for a, b in slices):
        return _no(SplitReason.EMPTY_UBATCH,
                   f"{num_tokens} tokens leave a ubatch of padding only: {list(slices)}")
    rows = max(b - a for a, b in slices)
    return LocalDecision(Vote.YES, slices, SplitReason.SPLIT, "", rows, bool(decode_only), two_chunk,
                         refill, max_fill)


def encode_vote(decision: LocalDecision, config: SplitConfig) -> list[int]:
    """The ints every rank contributes to the MAX all-reduce: yes, no, rows, the number of
    ubatches (and its negation), decode and prefill among the yes votes, the negated
    ``max_fill``, and the config's agreement key (and its negation)."""
    yes = decision.vote is Vote.YES
    key = config.agreement_key()
    return [int(yes), int(decision.vote is Vote.NO), decision.rows if yes else 0,
            config.num_ubatches, -config.num_ubatches, int(yes and decision.decode),
            int(yes and not decision.decode), -decision.max_fill if yes else -NEVER_SPLIT, key, -key]


_MIB = 1 << 20
_NO_RANK = -(1 << 40)


def encode_room(rank: int, free_bytes: int | None, need_bytes: int | None) -> list[int]:
    """The 4 ints a rank adds to the vote for the room check: whether it is short of device
    memory for the call (``free_bytes < need_bytes``), its negated rank, the need in MiB and its
    negated free MiB; the MAX over the group names the lowest short rank, the largest need and
    the least free memory."""
    if need_bytes is None or free_bytes is None or free_bytes >= need_bytes:
        return [0, _NO_RANK, 0, _NO_RANK]
    return [1, -rank, -(-need_bytes // _MIB), -(free_bytes // _MIB)]


def check_room(reduced: Sequence[int]) -> None:
    """Raise :class:`~dbo.errors.DeviceMemoryError` if the group's MAX of :func:`encode_room`
    vectors says a rank is short of device memory for the call: every rank raises it, before
    any of the call's all-to-alls."""
    short, neg_rank, need_mib, neg_free_mib = (int(v) for v in reduced)
    if not short:
        return
    rank, need, free = -neg_rank, need_mib * _MIB, -neg_free_mib * _MIB
    raise DeviceMemoryError(
        f"rank {rank} is short of device memory for this call: {free / 2**30:.2f} GiB free, about "
        f"{need / 2**30:.2f} GiB needed even unsplit (the autotune's measure; the least free and the "
        "largest need where several ranks are short): no rank ran it and the group is still in "
        "step; call again with fewer tokens on that rank",
        rank=rank, free_bytes=free, need_bytes=need)


def resolve_plan(num_tokens: int, decision: LocalDecision, config: SplitConfig,
                 reduced: Sequence[int]) -> UBatchPlan:
    """This rank's plan from its own decision and the group's element-wise MAX of
    :func:`encode_vote` vectors (its own vector, for a group of one). Pure."""
    any_yes, any_no, max_rows, max_n, neg_min_n, any_decode, any_prefill, neg_fill, key, neg_key = \
        (int(v) for v in reduced)
    if max_n != -neg_min_n:
        raise ValueError(f"SplitConfig.num_ubatches differs across ranks (from {-neg_min_n} to {max_n})")
    if key != -neg_key:
        raise ValueError("SplitConfig differs across ranks in mode, pad_to_multiple, cudagraph_sizes, "
                         "allow_mixed_kinds, num_speculative_tokens or expert_schedule")
    if any_yes and not any_no:
        if any_decode and any_prefill and not config.allow_mixed_kinds:
            return no_split_plan(num_tokens, SplitReason.MIXED_KINDS,
                                 "decode batches on some ranks, prefill on others")
        n, m = config.num_ubatches, config.pad_to_multiple
        padded = -(-max_rows // m) * m
        graph = graph_padded_size(padded, n, config.cudagraph_sizes)
        padded = padded if graph is None else graph // n
        if padded > -neg_fill:  # every rank sees the same reduced vector, so all fall back
            return no_split_plan(num_tokens, SplitReason.EMPTY_UBATCH,
                                 f"at {padded} rows per ubatch a rank's last ubatch is padding only")
        slices = decision.slices
        if decision.refill is not None:
            counts, unit = decision.refill
            slices = fill_cuts(num_tokens, padded, n, request_token_counts=counts, unit=unit)
            assert slices is not None, "a padded size >= every rank's need must fit"
        return UBatchPlan(num_tokens, slices, padded, SplitReason.SPLIT, graph_size=graph,
                          two_chunk=decision.two_chunk, expert_schedule=config.expert_schedule)
    if decision.vote is Vote.YES:
        reason, detail = SplitReason.DISAGREEMENT, "another rank of the group did not split"
    elif decision.vote is Vote.ABSTAIN:
        reason = SplitReason.EMPTY if not any_no else SplitReason.DISAGREEMENT
        detail = decision.detail if not any_no else "this rank is empty and another did not split"
    else:
        reason, detail = decision.reason, decision.detail
    # an unsplit schedule (sbo) is the config's own choice: it holds unless DBO is off
    sbo = (config.expert_schedule is ExpertSchedule.SBO and config.enabled
           and not dbo_disabled_by_env())
    return no_split_plan(num_tokens, reason, detail,
                         expert_schedule=ExpertSchedule.SBO if sbo else ExpertSchedule.PLAIN)


def no_split_plan(num_tokens: int, reason: SplitReason = SplitReason.DISABLED,
                  detail: str = "", expert_schedule: ExpertSchedule | str = ExpertSchedule.PLAIN
                  ) -> UBatchPlan:
    """A plan that runs the forward unsplit: plainly, or with the ``sbo`` expert schedule."""
    if reason is SplitReason.SPLIT:
        raise ValueError("no_split_plan needs a fallback reason")
    schedule = parse_expert_schedule(expert_schedule)
    if schedule.splits:
        raise ValueError(f"an unsplit plan's expert_schedule is 'plain' or 'sbo', not '{schedule}'")
    return UBatchPlan(num_tokens, ((0, num_tokens),), num_tokens, reason, detail,
                      expert_schedule=schedule)


# ---- pass 3: agreement ---------------------------------------------------------------------


def free_device_bytes(device: torch.device | str | None = None) -> int | None:
    """Device memory this rank can still use: the driver's free memory plus what torch's caching
    allocator holds unused (CUDA; no host sync); None on the CPU (no limit known)."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def plan_ubatches(
    num_tokens: int,
    config: SplitConfig | None = None,
    *,
    request_token_counts: Sequence[int] | None = None,
    decode_only: bool | None = None,
    split_points: Sequence[int] | None = None,
    group: Any = None,
    agree: bool = True,
    device: torch.device | str | None = None,
    free_bytes: int | None = None,
    need_bytes: int | None = None,
) -> UBatchPlan:
    """Decide how this rank runs a forward of ``num_tokens`` token rows.

    Every rank of ``group`` must call this for the same forward (it issues one collective).
    The result is consistent across the group: all ranks split, into the same number of
    ubatches of the same ``padded_size``, or none does. A fallback is logged once per reason.

    Args:
        num_tokens: rows of this rank's token-major inputs (may be 0).
        config: thresholds, mode, number of ubatches (default :class:`SplitConfig`).
        request_token_counts: tokens of each request in batch order, summing to
            ``num_tokens``; needed by ``SplitMode.REQUESTS``, used by FILL and to tell
            decode-only batches. Pass a list: a tensor costs a host sync.
        decode_only: whether the batch holds decodes only (default: inferred, see
            :func:`local_vote`).
        split_points: this rank's own cut rows (``num_ubatches - 1`` of them), replacing the
            mode's cuts (an engine that has decided where to cut).
        group: the ``torch.distributed`` process group that must agree (the group the MoE
            all-to-all runs over); None is the default group. Ignored when torch.distributed
            is not initialised.
        agree: False skips the all-reduce (a model that is not expert-parallel).
        device: where the 10-int64 all-reduce tensor lives (default: the current CUDA device
            for NCCL, CPU otherwise); the device whose free memory ``config.min_free_bytes``
            is checked against.
        free_bytes: this rank's free device memory, where the caller knows it better (an
            engine's own accounting); default: :func:`free_device_bytes`.
        need_bytes: the device memory this rank's call needs even unsplit (for example its
            tokens times the plain forward's transient bytes per token, as measured): where a
            rank of the group has less free, every rank raises
            :class:`~dbo.errors.DeviceMemoryError` here, before the call's first all-to-all,
            rather than one rank running out of memory mid-call while its peers wait for it.
            Every rank passes it or none (it makes the group vote even where the config never
            splits).

    Returns:
        This rank's :class:`UBatchPlan`.

    Raises:
        ValueError: ``num_tokens`` < 0, counts that do not sum to it, REQUESTS mode without
            counts, bad ``split_points``, or a config that differs across ranks.
        DeviceMemoryError: a rank has less device memory free than its ``need_bytes``.
    """
    config = SplitConfig() if config is None else config
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if isinstance(request_token_counts, torch.Tensor):
        request_token_counts = request_token_counts.tolist()
    decision = local_vote(num_tokens, config, request_token_counts=request_token_counts,
                          decode_only=decode_only, split_points=split_points)
    split_needs_room = decision.vote is Vote.YES and bool(config.min_free_bytes)
    free = None
    if split_needs_room or need_bytes is not None:
        free = free_device_bytes(device) if free_bytes is None else int(free_bytes)
    if split_needs_room and free is not None and free < config.min_free_bytes:
        decision = _no(SplitReason.MEMORY, f"{free / 2**30:.2f} GiB free on this rank, the "
                                           f"split needs {config.min_free_bytes / 2**30:.2f} GiB")
    vote = encode_vote(decision, config)
    vec = vote + encode_room(group_rank(group), free, need_bytes)
    if agree and (not config.never_splits or need_bytes is not None) and group_size(group) > 1:
        vec = all_reduce_max(vec, group, device=device)
    check_room(vec[len(vote):])
    plan = resolve_plan(num_tokens, decision, config, vec[:len(vote)])
    FALLBACK_LOG.note(plan)
    return plan
