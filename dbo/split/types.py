"""The types of a split decision: the config, the plan, the modes, the reasons and the votes.

:mod:`dbo.split` decides; these record what was asked for and what was decided. Re-exported by
:mod:`dbo.split`, where callers import them from.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field

import torch

from dbo.expert_schedule import ExpertSchedule, parse_expert_schedule
from dbo.split.policies import Slice

__all__ = ["NEVER_SPLIT", "SplitMode", "SplitReason", "Vote", "SplitConfig", "UBatchPlan"]


class SplitMode(str, enum.Enum):
    """Where the cuts go (the policies of :mod:`dbo.split.policies`)."""

    TOKENS = "tokens"  #: even token counts; a request may straddle a cut (draft tokens never do)
    REQUESTS = "requests"  #: at request boundaries, balanced by tokens (two-chunk if configured)
    FILL = "fill"  #: whole requests filling each ubatch up to the padded size, padding last


class SplitReason(str, enum.Enum):
    """Why a plan splits or does not. Every value but ``SPLIT`` is a fallback to the plain forward."""

    SPLIT = "split"
    DISABLED = "disabled"  #: SplitConfig(enabled=False) or DBO_DISABLE on this rank
    BELOW_THRESHOLD = "below_threshold"  #: this rank has fewer tokens than its threshold
    TOO_FEW_REQUESTS = "too_few_requests"  #: REQUESTS mode with fewer requests than ubatches
    EMPTY_UBATCH = "empty_ubatch"  #: a rank with tokens would run a ubatch of padding only
    MIXED_KINDS = "mixed_kinds"  #: decode on some ranks, prefill on others
    EMPTY = "empty"  #: no rank of the group has a token
    DISAGREEMENT = "disagreement"  #: this rank wanted to split, another rank did not
    MEASURED = "measured"  #: the wrapper measured the plain forward faster at this size
    MEASURING = "measuring"  #: the wrapper is timing the candidates at this size; this call runs unsplit
    MEMORY = "memory"  #: this rank had less device memory free than SplitConfig.min_free_bytes


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
    """When and how to split. Every field but the thresholds and ``enabled`` must be the same
    on every rank of the group (checked in the vote).

    Attributes:
        num_ubatches: ubatches per split batch (>= 2).
        mode: :class:`SplitMode` (or its string value).
        decode_token_threshold: a decode-only batch is split when it has at least this many
            tokens on this rank. Default 32.
        prefill_token_threshold: a batch with any prefill (or of unknown kind) is split when it
            has at least this many tokens. Default 512.
        pad_to_multiple: round the padded ubatch size up to a multiple of this. Default 1.
        enabled: False runs every forward plainly (as does ``DBO_DISABLE=1``).
        two_chunk_threshold: REQUESTS mode cuts one request in two at the token midpoint when
            the best request-boundary cut scores a :func:`~dbo.split.policies.token_balance`
            below this (SGLang's ``tbo_token_distribution_threshold``, 0.48 there). Default 0:
            never, so REQUESTS mode keeps every request whole unless asked.
        num_speculative_tokens: draft tokens per request in a speculative decode step; a batch
            whose requests all carry ``1 + num_speculative_tokens`` tokens counts as decode, and
            no cut separates a request's tokens. Default 0.
        cudagraph_sizes: captured whole-batch sizes; a split batch pads to the smallest one
            that is a multiple of ``num_ubatches`` and holds the group's largest ubatch in each
            equal share (eager, as without it, when none does). Default none.
        allow_mixed_kinds: split even when some ranks run decode batches and others prefill
            (or mixed) ones. Default False.
        expert_schedule: :class:`~dbo.expert_schedule.ExpertSchedule` (or its string value):
            ``"split"`` (default: each ubatch runs its own routed experts), ``"merged"`` (the
            ubatches' routed experts run as one grouped call once every ubatch has received
            its tokens: one read of the weights), ``"sbo+dbo"`` (split, each ubatch's MoE layers
            with the shared experts beside the dispatch and a combine per expert group where
            the backend combines per group), ``"sbo"`` (never split: single-batch overlap) or
            ``"plain"`` (never split: like both
            thresholds at :data:`NEVER_SPLIT`, it issues no collective, so every rank of the
            group must use it). Part of the agreement: ranks that split must run the same one.
        adaptive: a :class:`dbo.DBOWrapper` with this config measures its first split calls
            at each size bucket plainly and with each expert schedule, and keeps the fastest
            (:mod:`dbo.split.online`): a wrapper that nobody tuned does not lose to the plain
            forward. Default True; :func:`dbo.autotune.autotune_split_config` returns False
            (its thresholds and schedule were measured), and so does a config that asks for
            exactly what it wants. Part of the agreement.
        min_free_bytes: split only where every rank of the group has at least this much device
            memory free (the driver's free memory plus what torch's allocator holds unused) when
            the plan is made; a rank with less votes no, and the whole group runs the plain
            forward, whose transient memory is smaller (a rank whose batch grew, say, makes
            every rank fall back rather than run out of memory in the overlapped call while its
            peers wait). Default 0: no check. :func:`dbo.autotune.autotune_split_config` sets it
            to the overlapped call's measured transient peak. Not part of the agreement (each
            rank checks its own memory).
    """

    num_ubatches: int = 2
    mode: SplitMode = SplitMode.TOKENS
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512
    pad_to_multiple: int = 1
    enabled: bool = True
    two_chunk_threshold: float = 0.0
    num_speculative_tokens: int = 0
    cudagraph_sizes: tuple[int, ...] = ()
    allow_mixed_kinds: bool = False
    expert_schedule: ExpertSchedule = ExpertSchedule.SPLIT
    adaptive: bool = True
    min_free_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_ubatches, bool) or not isinstance(self.num_ubatches, int) \
                or self.num_ubatches < 2:
            raise ValueError(f"num_ubatches must be an int >= 2, got {self.num_ubatches!r}")
        try:
            object.__setattr__(self, "mode", SplitMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in SplitMode]}, "
                             f"got {self.mode!r}") from None
        for name in ("decode_token_threshold", "prefill_token_threshold", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.pad_to_multiple, int) or self.pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be an int >= 1, got {self.pad_to_multiple!r}")
        if not isinstance(self.two_chunk_threshold, int | float) or not 0 <= self.two_chunk_threshold <= 0.5:
            raise ValueError(f"two_chunk_threshold must be in [0, 0.5], got {self.two_chunk_threshold!r}")
        sizes = tuple(sorted(set(self.cudagraph_sizes)))
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"cudagraph_sizes must be ints >= 1, got {self.cudagraph_sizes!r}")
        object.__setattr__(self, "cudagraph_sizes", sizes)
        object.__setattr__(self, "expert_schedule", parse_expert_schedule(self.expert_schedule))
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {self.adaptive!r}")
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int) \
                or self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be an int >= 0, got {self.min_free_bytes!r}")

    @property
    def never_splits(self) -> bool:
        """True when no batch splits on any rank under this config (both thresholds
        :data:`NEVER_SPLIT`, or the ``plain`` schedule): the decision needs no collective."""
        return (not self.expert_schedule.splits
                or min(self.decode_token_threshold, self.prefill_token_threshold) >= NEVER_SPLIT)

    def threshold(self, decode_only: bool) -> int:
        """The token threshold for a decode-only batch or any other."""
        return self.decode_token_threshold if decode_only else self.prefill_token_threshold

    def agreement_key(self) -> int:
        """A 31-bit digest of the fields every rank must share (compared in the vote)."""
        shared = (self.mode.value, self.num_ubatches, self.pad_to_multiple, self.cudagraph_sizes,
                  self.allow_mixed_kinds, self.num_speculative_tokens, self.expert_schedule.value,
                  self.adaptive)
        return zlib.crc32(repr(shared).encode()) & 0x7FFFFFFF


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
        graph_size: the captured CUDA-graph size the whole split batch pads to
            (``num_ubatches * padded_size``), or None (no ``cudagraph_sizes``, none large
            enough, or not split).
        two_chunk: True when the cuts split a request in two by the two-chunk rule.
        expert_schedule: how the routed experts run: ``split``, ``merged`` or ``sbo+dbo`` in a
            split plan (default ``split``); ``plain`` (default) or ``sbo`` in a plan that does not
            split.
    """

    num_tokens: int
    slices: tuple[Slice, ...]
    padded_size: int
    reason: SplitReason
    detail: str = field(default="", compare=False)
    graph_size: int | None = None
    two_chunk: bool = False
    expert_schedule: ExpertSchedule | None = None

    def __post_init__(self) -> None:
        schedule = None if self.expert_schedule is None else parse_expert_schedule(self.expert_schedule)
        if not self.split:
            schedule = ExpertSchedule.SBO if schedule is ExpertSchedule.SBO else ExpertSchedule.PLAIN
        elif schedule is None:
            schedule = ExpertSchedule.SPLIT
        elif not schedule.splits:
            raise ValueError(f"a split plan's expert_schedule is 'split', 'merged' or 'sbo+dbo', not "
                             f"'{schedule}'")
        object.__setattr__(self, "expert_schedule", schedule)

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
        """Padding rows of ubatch ``i``; they come after its real rows."""
        return self.padded_size - self.num_valid(i)

    @property
    def valid_rows(self) -> tuple[int, ...]:
        """Real rows of each ubatch."""
        return tuple(self.num_valid(i) for i in range(self.num_ubatches))

    @property
    def padding_rows(self) -> tuple[int, ...]:
        """Padding rows of each ubatch."""
        return tuple(self.num_padding(i) for i in range(self.num_ubatches))

    def valid_mask(self, i: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``bool[padded_size]``: True for ubatch ``i``'s real rows. No host sync."""
        return torch.arange(self.padded_size, device=device) < self.num_valid(i)

    def __str__(self) -> str:
        if not self.split:
            return f"plain({self.num_tokens} tokens; {self.reason.value}: {self.detail})"
        parts = " ".join(f"[{a}:{b})" for a, b in self.slices)
        extra = (f", graph {self.graph_size}" if self.graph_size else "") + \
            (", two-chunk" if self.two_chunk else "") + \
            ("" if self.expert_schedule is ExpertSchedule.SPLIT else f", {self.expert_schedule} experts")
        return f"split({self.num_tokens} tokens -> {parts} padded to {self.padded_size}{extra})"
