"""SplitConfig.min_free_bytes on a GPU: the free memory read without a host sync, and a split
that needs more than is free falls back to the plain forward (the same output).

Run: python3 -m pytest -q tests/gpu/test_memory_gpu.py -rA
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dbo import overlapped_forward
from dbo.split import SplitConfig, SplitReason, free_device_bytes, plan_ubatches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_free_memory_counts_the_allocators_unused_blocks(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    assert 0 < free_device_bytes(dev) <= total
    # The driver's free memory is the whole device's: another process allocating or freeing
    # meanwhile moves it by any amount. Held fixed, what is left is this process's allocator.
    driver_free = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, total))
    x = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB in use
    held = free_device_bytes(dev)
    assert driver_free <= held
    del x  # back to the allocator's cache: free for dbo's purpose, though not for the driver
    assert free_device_bytes(dev) == held + (256 << 20)


def test_a_split_that_needs_more_than_is_free_runs_plainly():
    x = torch.randn(64, 32, device="cuda")
    total = torch.cuda.get_device_properties(x.device).total_memory
    cfg = SplitConfig(decode_token_threshold=1, prefill_token_threshold=1)
    assert plan_ubatches(64, dataclasses.replace(cfg, min_free_bytes=1 << 20)).split
    tight = dataclasses.replace(cfg, min_free_bytes=2 * total)
    plan = plan_ubatches(64, tight)
    assert not plan.split and plan.reason is SplitReason.MEMORY
    torch.testing.assert_close(overlapped_forward(lambda h: h * 2, x, config=tight), x * 2)
