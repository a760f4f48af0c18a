"""Where to cut a batch into ubatches: the plan, its types, the policies, padding, the log of
fallbacks and each ubatch's attention metadata.

:mod:`dbo.split.plan` decides (one vote per rank, one all-reduce); :mod:`dbo.split.policies`
are the pure cut rules it picks from; :mod:`dbo.split.types` records what was asked for and
decided; :mod:`dbo.split.padding` pads split batches and masks their padding rows;
:mod:`dbo.split.log` logs each fallback reason once; :mod:`dbo.split.attention` gives each
ubatch the attention metadata of the requests (or request parts) it holds. Callers import the
public names from here. See ``docs/splitting.md``.
"""

from dbo.expert_schedule import ExpertSchedule
from dbo.split.attention import RequestPart, UBatchAttention, split_attention_metadata
from dbo.split.log import FALLBACK_LOG, FallbackLog
from dbo.split.padding import graph_padded_size, mask_padding_routing
from dbo.split.plan import (
    DISABLE_ENV_VAR,
    LocalDecision,
    check_room,
    dbo_disabled_by_env,
    encode_room,
    encode_vote,
    free_device_bytes,
    local_vote,
    no_split_plan,
    plan_ubatches,
    resolve_plan,
)
from dbo.split.policies import (
    fill_cuts,
    split_at,
    split_requests,
    split_requests_two_chunk,
    split_tokens,
)
from dbo.split.rows import check_token_major, merge_outputs, split_inputs
from dbo.split.types import NEVER_SPLIT, SplitConfig, SplitMode, SplitReason, UBatchPlan, Vote

__all__ = [
    "DISABLE_ENV_VAR",
    "NEVER_SPLIT",
    "SplitMode",
    "SplitReason",
    "ExpertSchedule",
    "SplitConfig",
    "UBatchPlan",
    "Vote",
    "split_tokens",
    "split_requests",
    "split_requests_two_chunk",
    "split_at",
    "fill_cuts",
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
    "graph_padded_size",
    "mask_padding_routing",
    "FallbackLog",
    "FALLBACK_LOG",
    "RequestPart",
    "UBatchAttention",
    "split_attention_metadata",
    "check_token_major",
    "split_inputs",
    "merge_outputs",
]
