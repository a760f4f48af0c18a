"""dbo: dual-batch overlap for mixture-of-experts inference.

Cut a batch into ubatches that run interleaved on one CPU thread, so that one ubatch's
expert-parallel all-to-all runs on a comm stream while another's matmuls run on the compute
stream. See README.md.
"""

from dbo.errors import (
    CollectiveTimeoutError,
    DBOError,
    HookMisuseError,
    HookSlotOccupiedError,
    NestedRunError,
    StreamStateError,
    UBatchCountError,
    UBatchError,
)
from dbo.expert_schedule import ExpertSchedule
from dbo.overlap import DBOWrapper, RunOptions, overlapped_forward
from dbo.split import SplitConfig, SplitMode, UBatchPlan, plan_ubatches, split_attention_metadata
from dbo.ubatch.context import (
    UBatchContext,
    active_run,
    dbo_current_context,
    dbo_current_ubatch_id,
    dbo_current_ubatch_token_offset,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_num_live_ubatches,
    dbo_num_ubatches,
    dbo_region,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_deferred,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo.ubatch.trace import Trace

__version__ = "0.1.0"

__all__ = [
    "run_ubatches",
    "UBatchContext",
    "Trace",
    "SplitConfig",
    "SplitMode",
    "ExpertSchedule",
    "UBatchPlan",
    "plan_ubatches",
    "split_attention_metadata",
    "DBOWrapper",
    "RunOptions",
    "overlapped_forward",
    "active_run",
    "dbo_enabled",
    "dbo_num_ubatches",
    "dbo_num_live_ubatches",
    "dbo_current_context",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_token_offset",
    "dbo_yield",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute_sync",
    "dbo_switch_to_compute_deferred",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_get_previous_event",
    "dbo_region",
    "DBOError",
    "UBatchError",
    "UBatchCountError",
    "NestedRunError",
    "HookMisuseError",
    "HookSlotOccupiedError",
    "StreamStateError",
    "CollectiveTimeoutError",
]
