"""Where to cut a batch into ubatches, and whether every rank of a group agrees to.

Three separate passes, the first two pure:

1. :func:`split_tokens` / :func:`split_requests` give the cut points of one rank's batch (at
   even token counts, a request may straddle a cut; or at request boundaries, balanced by
   token count).
2. :func:`local_vote` applies the off switches and the thresholds to one rank's batch and says
   whether this rank wants to split; :func:`resolve_plan` turns the group's reduced votes into
   this rank's :class:`UBatchPlan`.
3. :func:`plan_ubatches` runs both with one ``all_reduce`` (op MAX, five int64) in between, so
   every rank of the group splits or none does, and when they split they all run the same
   number of ubatches of the same padded size: the all-to-all collectives inside the model are
   then issued in the same order, with the same shapes, everywhere. A rank with fewer tokens
   pads; a rank with no tokens abstains from the vote and pads every ubatch.

Padding rows sit at the end of each ubatch (rows ``num_valid(i):padded_size``); they must route
to no expert (:func:`mask_padding_routing` gives them ``topk_ids = -1`` and weight 0) and their
outputs are dropped on merge.

Thresholds (defaults as vLLM's ``dbo_decode_token_threshold`` / ``dbo_prefill_token_threshold``):
a decode-only batch is split from 32 tokens on, a batch with any prefill from 512. Below that
each half is too small for its matmuls to run efficiently and the all-to-all is latency-bound,
so overlapping costs more (extra launches, padding, a yield per layer) than it hides.

The environment variable ``DBO_DISABLE`` (``1``/``true``/``yes``/``on``) switches splitting
off for the whole process, as does ``SplitConfig(enabled=False)``. A disabled rank still takes
part in the vote (it votes no), so a switch set on some ranks only cannot desynchronise the
group's collectives; it costs that one small all-reduce.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DISABLE_ENV_VAR",
    "NEVER_SPLIT",
    "SplitMode",
    "SplitReason",
    "SplitConfig",
    "UBatchPlan",
    "Vote",
    "split_tokens",
    "split_requests",
    "LocalDecision",
    "local_vote",
    "encode_vote",
    "resolve_plan",
    "plan_ubatches",
    "no_split_plan",
    "dbo_disabled_by_env",
    "mask_padding_routing",
    "FallbackLog",
    "FALLBACK_LOG",
]

logger = logging.getLogger(__name__)

#: set to 1/true/yes/on to run every forward plainly (read at each decision)
DISABLE_ENV_VAR = "DBO_DISABLE"

Slice = tuple[int, int]


class SplitMode(str, enum.Enum):
    """Where the cuts go."""

    TOKENS = "tokens"  #: even token counts; a request may straddle a cut
    REQUESTS = "requests"  #: at request boundaries, balanced by token count


class SplitReason(str, enum.Enum):
    """Why a plan splits or does not. Every value but ``SPLIT`` is a fallback to the plain forward."""

    SPLIT = "split"
    DISABLED = "disabled"  #: SplitConfig(enabled=False) or DBO_DISABLE on this rank
    BELOW_THRESHOLD = "below_threshold"  #: this rank has fewer tokens than its threshold
    TOO_FEW_REQUESTS = "too_few_requests"  #: REQUESTS mode with fewer requests than ubatches
    EMPTY = "empty"  #: no rank of the group has a token
    DISAGREEMENT = "disagreement"  #: this rank wanted to split, another rank did not


class Vote(enum.IntEnum):
    """One rank's wish, before the group's all-reduce."""

    NO = 0
    YES = 1
    ABSTAIN = 2  #: a rank with no tokens goes along with the others


#: a token threshold no batch reaches. A config whose two thresholds are both this never
#: splits on any rank, so :func:`plan_ubatches` issues no collective for it: every rank of
#: the group must then use such a config (dbo.autotune gives every rank the same one).
NEVER_SPLIT = 2**62


@dataclass(frozen=True)
class SplitConfig:
    """When and how to split.

    Attributes:
        num_ubatches: ubatches per split batch (>= 2); must be the same on every rank.
        mode: :class:`SplitMode` (or its string value).
        decode_token_threshold: a decode-only batch is split when it has at least this many
            tokens on this rank. Default 32.
        prefill_token_threshold: a batch with any prefill (or of unknown kind) is split when it
            has at least this many tokens. Default 512.
        pad_to_multiple: round the padded ubatch size up to a multiple of this (e.g. a CUDA
            graph bucket size). Default 1.
        enabled: False runs every forward plainly (as does ``DBO_DISABLE=1``).
    """

    num_ubatches: int = 2
    mode: SplitMode = SplitMode.TOKENS
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512
    pad_to_multiple: int = 1
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.num_ubatches, bool) or not isinstance(self.num_ubatches, int) \
                or self.num_ubatches < 2:
            raise ValueError(f"num_ubatches must be an int >= 2, got {self.num_ubatches!r}")
        try:
            object.__setattr__(self, "mode", SplitMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in SplitMode]}, "
                             f"got {self.mode!r}") from None
        for name in ("decode_token_threshold", "prefill_token_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.pad_to_multiple, int) or self.pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be an int >= 1, got {self.pad_to_multiple!r}")

    def threshold(self, decode_only: bool) -> int:
        """The token threshold for a decode-only batch or any other."""
        return self.decode_token_threshold if decode_only else self.prefill_token_threshold


@dataclass(frozen=True)
class UBatchPlan:
    """How one rank runs one forward: split into ubatches, or plainly.

    Attributes:
        num_tokens: this rank's real tokens (rows of its token-major inputs).
        slices: ``(start, stop)`` rows of this rank's batch in each ubatch, in order, covering
            ``0..num_tokens`` without gaps. A plan that does not split has one slice,
            ``(0, num_tokens)``.
        padded_size: rows of every ubatch after padding, the same on every rank of the group
            (``num_tokens`` when not split). Ubatch ``i``'s rows ``num_valid(i):padded_size``
            are padding.
        reason: :class:`SplitReason`; ``SPLIT`` or why the forward falls back.
        detail: a human-readable note on the reason.
    """

    num_tokens: int
    slices: tuple[Slice, ...]
    padded_size: int
    reason: SplitReason
    detail: str = field(default="", compare=False)

    @property
    def split(self) -> bool:
        """True when the forward runs as ubatches."""
        return self.reason is SplitReason.SPLIT

    @property
    def num_ubatches(self) -> int:
        return len(self.slices)

    @property
    def token_offsets(self) -> tuple[int, ...]:
        """Each ubatch's first row in this rank's batch (for ``run_ubatches(token_offsets=)``)."""
        return tuple(s for s, _ in self.slices)

    def num_valid(self, i: int) -> int:
        """Real (non-padding) rows of ubatch ``i``; they come first."""
        start, stop = self.slices[i]
        return stop - start

    def num_padding(self, i: int) -> int:
        return self.padded_size - self.num_valid(i)

    def valid_mask(self, i: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``bool[padded_size]``: True for ubatch ``i``'s real rows. No host sync."""
        return torch.arange(self.padded_size, device=device) < self.num_valid(i)

    def __str__(self) -> str:
        if not self.split:
            return f"plain({self.num_tokens} tokens; {self.reason.value}: {self.detail})"
        parts = " ".join(f"[{a}:{b})" for a, b in self.slices)
        return f"split({self.num_tokens} tokens -> {parts} padded to {self.padded_size})"


# ---- pass 1: cut points --------------------------------------------------------------------


def split_tokens(num_tokens: int, num_ubatches: int) -> tuple[Slice, ...]:
    """Cut ``num_tokens`` rows into ``num_ubatches`` contiguous slices whose sizes differ by at
    most one (larger ones first). Slices may be empty when ``num_tokens < num_ubatches``."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    base, extra = divmod(num_tokens, num_ubatches)
    out = []
    start = 0
    for i in range(num_ubatches):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def split_requests(request_token_counts: Sequence[int], num_ubatches: int) -> tuple[Slice, ...] | None:
    """Cut at request boundaries into ``num_ubatches`` slices of whole requests, balanced by
    token count; None when there are fewer requests than ubatches.

    Cut ``j`` goes to the request boundary nearest ``j * total / num_ubatches`` that keeps at
    least one request in every ubatch (ties go to the earlier boundary). For two ubatches this
    minimises the larger ubatch, hence the padded size.

    Args:
        request_token_counts: tokens of each request, in batch order (ints >= 0).
    Returns:
        ``(start, stop)`` token rows of each ubatch.
    """
    counts = [int(c) for c in request_token_counts]
    if any(c < 0 for c in counts):
        raise ValueError("request_token_counts must be >= 0")
    num_requests = len(counts)
    if num_requests < num_ubatches:
        return None
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    total = prefix[-1]
    cuts = [0]  # request indices where each ubatch starts
    for j in range(1, num_ubatches):
        lo = cuts[-1] + 1  # at least one request in the previous ubatch
        hi = num_requests - (num_ubatches - j)  # at least one request left for each later one
        target = j * total / num_ubatches
        best = min(range(lo, hi + 1), key=lambda k: (abs(prefix[k] - target), k))
        cuts.append(best)
    cuts.append(num_requests)
    return tuple((prefix[a], prefix[b]) for a, b in zip(cuts, cuts[1:], strict=False))


# ---- pass 2: votes and their resolution ----------------------------------------------------


def dbo_disabled_by_env() -> bool:
    """True when the ``DBO_DISABLE`` environment variable switches splitting off."""
    return os.environ.get(DISABLE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class LocalDecision:
    """One rank's vote, its cut points (for YES and ABSTAIN) and the reason behind a NO."""

    vote: Vote
    slices: tuple[Slice, ...]  # this rank's cut points when vote is YES or ABSTAIN
    reason: SplitReason
    detail: str


def local_vote(
    num_tokens: int,
    config: SplitConfig,
    *,
    request_token_counts: Sequence[int] | None = None,
    decode_only: bool | None = None,
) -> LocalDecision:
    """This rank's wish and cut points, before agreement. Pure; no collective, no host sync.

    ``decode_only=None`` infers it from ``request_token_counts`` (every request has one
    token); with no counts the batch counts as mixed (the larger threshold applies).
    """
    if request_token_counts is not None and sum(int(c) for c in request_token_counts) != num_tokens:
        raise ValueError(f"request_token_counts sum to {sum(request_token_counts)}, "
                         f"not num_tokens={num_tokens}")
    n = config.num_ubatches
    if not config.enabled or dbo_disabled_by_env():
        why = "SplitConfig(enabled=False)" if not config.enabled else f"{DISABLE_ENV_VAR} is set"
        return LocalDecision(Vote.NO, (), SplitReason.DISABLED, why)
    if num_tokens == 0:
        return LocalDecision(Vote.ABSTAIN, ((0, 0),) * n, SplitReason.EMPTY, "no tokens on any rank")
    if decode_only is None:
        decode_only = request_token_counts is not None and all(int(c) == 1 for c in request_token_counts)
    threshold = config.threshold(decode_only)
    if num_tokens < threshold:
        kind = "decode" if decode_only else "prefill/mixed"
        return LocalDecision(Vote.NO, (), SplitReason.BELOW_THRESHOLD,
                              f"{num_tokens} tokens < {kind} threshold {threshold}")
    if config.mode is SplitMode.REQUESTS:
        if request_token_counts is None:
            raise ValueError("SplitMode.REQUESTS needs request_token_counts")
        slices = split_requests(request_token_counts, n)
        if slices is None:
            return LocalDecision(Vote.NO, (), SplitReason.TOO_FEW_REQUESTS,
                                  f"{len(request_token_counts)} requests < {n} ubatches")
    else:
        slices = split_tokens(num_tokens, n)
    return LocalDecision(Vote.YES, slices, SplitReason.SPLIT, "")


def encode_vote(decision: LocalDecision, num_ubatches: int) -> list[int]:
    """The five ints every rank contributes to the MAX all-reduce."""
    rows = max((b - a for a, b in decision.slices), default=0)
    return [int(decision.vote is Vote.YES), int(decision.vote is Vote.NO), rows,
            num_ubatches, -num_ubatches]


def resolve_plan(num_tokens: int, decision: LocalDecision, config: SplitConfig,
                 reduced: Sequence[int]) -> UBatchPlan:
    """This rank's plan from its own decision and the group's element-wise MAX of
    :func:`encode_vote` vectors (its own vector, for a group of one). Pure."""
    any_yes, any_no, max_rows, max_n, neg_min_n = (int(v) for v in reduced)
    if max_n != -neg_min_n:
        raise ValueError(f"SplitConfig.num_ubatches differs across ranks (from {-neg_min_n} to {max_n})")
    if any_yes and not any_no:
        m = config.pad_to_multiple
        padded = -(-max_rows // m) * m
        return UBatchPlan(num_tokens, decision.slices, padded, SplitReason.SPLIT)
    if decision.vote is Vote.YES:
        reason, detail = SplitReason.DISAGREEMENT, "another rank of the group did not split"
    elif decision.vote is Vote.ABSTAIN:
        reason = SplitReason.EMPTY if not any_no else SplitReason.DISAGREEMENT
        detail = decision.detail if not any_no else "this rank is empty and another did not split"
    else:
        reason, detail = decision.reason, decision.detail
    return no_split_plan(num_tokens, reason, detail)


def no_split_plan(num_tokens: int, reason: SplitReason = SplitReason.DISABLED,
                  detail: str = "") -> UBatchPlan:
    """A plan that runs the plain forward."""
    if reason is SplitReason.SPLIT:
        raise ValueError("no_split_plan needs a fallback reason")
    return UBatchPlan(num_tokens, ((0, num_tokens),), num_tokens, reason, detail)


# ---- pass 3: agreement ---------------------------------------------------------------------


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _reduce_max(vec: list[int], group: Any, device: torch.device | str | None) -> list[int]:
    import torch.distributed as dist

    if device is None:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        if device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(vec, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()  # the one host sync of a decision


def plan_ubatches(
    num_tokens: int,
    config: SplitConfig | None = None,
    *,
    request_token_counts: Sequence[int] | None = None,
    decode_only: bool | None = None,
    group: Any = None,
    agree: bool = True,
    device: torch.device | str | None = None,
) -> UBatchPlan:
    """Decide how this rank runs a forward of ``num_tokens`` token rows.

    Every rank of ``group`` must call this for the same forward (it issues one collective).
    The result is consistent across the group: all ranks split, into the same number of
    ubatches of the same ``padded_size``, or none does. A fallback is logged once per reason.

    Args:
        num_tokens: rows of this rank's token-major inputs (may be 0).
        config: thresholds, mode, number of ubatches (default :class:`SplitConfig`).
        request_token_counts: tokens of each request in batch order, summing to
            ``num_tokens``; needed by ``SplitMode.REQUESTS`` and used to tell decode-only
            batches. Pass a list: a tensor costs a host sync.
        decode_only: whether the batch holds decodes only (default: inferred, see
            :func:`local_vote`).
        group: the ``torch.distributed`` process group that must agree (the group the MoE
            all-to-all runs over); None is the default group. Ignored when torch.distributed
            is not initialised.
        agree: False skips the all-reduce (a model that is not expert-parallel).
        device: where the 5-int64 all-reduce tensor lives (default: the current CUDA device
            for NCCL, CPU otherwise).

    Returns:
        This rank's :class:`UBatchPlan`.

    Raises:
        ValueError: ``num_tokens`` < 0, counts that do not sum to it, REQUESTS mode without
            counts, or ``num_ubatches`` that differs across ranks.
    """
    config = SplitConfig() if config is None else config
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if isinstance(request_token_counts, torch.Tensor):
        request_token_counts = request_token_counts.tolist()
    decision = local_vote(num_tokens, config, request_token_counts=request_token_counts,
                          decode_only=decode_only)
    vec = encode_vote(decision, config.num_ubatches)
    never = min(config.decode_token_threshold, config.prefill_token_threshold) >= NEVER_SPLIT
    if agree and not never and _group_size(group) > 1:
        vec = _reduce_max(vec, group, device)
    plan = resolve_plan(num_tokens, decision, config, vec)
    FALLBACK_LOG.note(plan)
    return plan


# ---- padding -------------------------------------------------------------------------------


def mask_padding_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         num_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Route rows ``num_valid:`` to no expert: ``topk_ids`` -1 and ``topk_weights`` 0.

    Args:
        topk_ids: ``[num_rows, topk]`` integer expert ids.
        topk_weights: ``[num_rows, topk]`` float weights.
        num_valid: real rows (the first ones), e.g. ``plan.num_valid(i)``.
    Returns:
        New ``(topk_ids, topk_weights)``; the inputs are not modified. No host sync.
    """
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must have the same shape")
    if num_valid >= topk_ids.shape[0]:
        return topk_ids, topk_weights
    valid = (torch.arange(topk_ids.shape[0], device=topk_ids.device) < num_valid).unsqueeze(1)
    ids = torch.where(valid, topk_ids, torch.full_like(topk_ids, -1))
    weights = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
    return ids, weights


# ---- logging each fallback reason once -----------------------------------------------------


class FallbackLog:
    """The fallback reasons already logged in this process (one registry, with ``reset()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[SplitReason] = set()

    def note(self, plan: UBatchPlan) -> bool:
        """Log ``plan``'s fallback reason if it was not logged before; True if logged now."""
        if plan.split:
            return False
        with self._lock:
            if plan.reason in self._seen:
                return False
            self._seen.add(plan.reason)
        level = logging.WARNING if plan.reason is SplitReason.DISAGREEMENT else logging.INFO
        logger.log(level, "dbo: running the plain forward (reason: %s; %s); logged once per reason",
                   plan.reason.value, plan.detail)
        return True

    @property
    def seen(self) -> frozenset[SplitReason]:
        return frozenset(self._seen)

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()


#: the process-wide registry of logged fallback reasons
FALLBACK_LOG = FallbackLog()
