"""dbo.bench.syncs on a machine without CUDA: nothing recorded, and the report's format."""

from __future__ import annotations

import pytest
import torch

from dbo.bench.syncs import SyncSite, format_sites, host_syncs

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path runs in tests/gpu")
def test_without_cuda_nothing_is_recorded():
    with host_syncs() as sites:
        torch.zeros(3).sum().item()
    assert sites == []
    assert "no synchronizing call" in format_sites(sites)


def test_report_lists_sites_innermost_frame_first():
    sites = [SyncSite(("/x/dbo/overlap.py:10 step", "/y/backends/naive.py:85 prepare_async",
                       "/z/dbo/moe/validate.py:86 check_routing_inputs"), count=4),
             SyncSite(("/x/examples/hf_moe.py:3 run",), count=1)]
    text = format_sites(sites, frames=2, limit=1).splitlines()
    assert text[0] == ("4 x dbo/moe/validate.py:86 check_routing_inputs <- "
                       "backends/naive.py:85 prepare_async")
    assert text[1] == "... and 1 more sites"
