"""dbo.ubatch.sm on a machine without CUDA green contexts: argument checks and clear errors.

The GPU side (the compute really confined, DBO == serial with it) is tests/gpu/test_partition_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from dbo import DBOWrapper, overlapped_forward
from dbo.errors import DBOError
from dbo.split import SplitConfig
from dbo.ubatch.sm import (
    PARTITIONS,
    SMPartitionUnsupportedError,
    check_compute_sms,
    compute_on_sms,
    green_contexts_supported,
)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_sm_counts_are_value_errors(bad):
    with pytest.raises(ValueError, match="compute_sms must be a positive int"):
        check_compute_sms(bad)
    with pytest.raises(ValueError):
        DBOWrapper(lambda x: x, compute_sms=bad)


def test_none_is_a_no_op():
    with compute_on_sms(None) as stream:
        assert stream is None
    assert check_compute_sms(None) is None


@pytest.mark.skipif(green_contexts_supported(), reason="this machine has green contexts")
def test_unsupported_is_a_named_error():
    assert issubclass(SMPartitionUnsupportedError, DBOError)
    with pytest.raises(SMPartitionUnsupportedError, match="green contexts"), compute_on_sms(8):
        pass
    with pytest.raises(SMPartitionUnsupportedError, match="CUDA device"), \
            compute_on_sms(8, torch.device("cpu")):
        pass
    assert len(PARTITIONS) == 0


def test_overlapped_forward_on_cpu_refuses_compute_sms_only_when_it_splits():
    x = torch.randn(64, 8)
    split = SplitConfig(prefill_token_threshold=1)
    # no split: a plain call, the option is not used
    never = SplitConfig(prefill_token_threshold=10_000)
    assert torch.equal(overlapped_forward(torch.tanh, x, config=never, agree=False, compute_sms=8),
                       torch.tanh(x))
    with pytest.raises(SMPartitionUnsupportedError):
        overlapped_forward(torch.tanh, x, config=split, agree=False, compute_sms=8)
    out = overlapped_forward(torch.tanh, x, config=split, agree=False, compute_sms=None)
    assert torch.equal(out, torch.tanh(x))


def test_run_ubatches_checks_compute_sms():
    from dbo import run_ubatches
    from dbo.ubatch.context import active_run

    with pytest.raises(ValueError, match="compute_sms"):
        run_ubatches([lambda: 1, lambda: 2], device="cpu", compute_sms=0)
    if not green_contexts_supported():
        with pytest.raises(SMPartitionUnsupportedError):
            run_ubatches([lambda: 1, lambda: 2], device="cpu", compute_sms=8)
    assert active_run() is None
    assert run_ubatches([lambda: 1, lambda: 2], device="cpu", compute_sms=None) == [1, 2]
