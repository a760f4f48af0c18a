"""Counting FSDP2's all-gathers (``hf-load``, ``test_hf_ep.py``): the counter sees what goes through
``torch.distributed``'s all-gathers, puts them back even when its block raises, and never sees
dbo's own collectives, whichever module was imported first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

# Patches torch.distributed's all-gathers before dbo is imported, as a counter entered first
# would; dbo's all-gather must still call torch's own, counted neither then nor later.
DBO_IMPORTED_UNDER_A_PATCH = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    reals = {n: getattr(dist, n) for n in names}
    seen = []

    def counting(real):
        def gather(output, *args, **kwargs):
            seen.append(output.numel())
            return real(output, *args, **kwargs)
        return gather

    for n in names:
        setattr(dist, n, counting(reals[n]))
    from dbo.backends.torchdist import all_gather_single
    for n in names:
        setattr(dist, n, reals[n])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = torch.empty(4)
    all_gather_single(out, torch.ones(4), None, False)
    for n in names:
        setattr(dist, n, counting(reals[n]))
    all_gather_single(out, torch.ones(4), None, False)
    dist.destroy_process_group()
    assert out.tolist() == [1.0] * 4
    print("counted", len(seen))
""")


def test_dbo_gathers_are_never_counted_whatever_the_import_order():
    proc = subprocess.run([sys.executable, "-c", DBO_IMPORTED_UNDER_A_PATCH], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "counted 0", proc.stdout


def test_the_counter_counts_and_puts_torch_back_on_failure():
    pytest.importorskip("transformers")
    from dbo.integrations.transformers.fsdp import ALL_GATHER_NAMES, count_all_gathered_bytes

    names = [n for n in ALL_GATHER_NAMES if hasattr(dist, n)]
    reals = {n: getattr(dist, n) for n in names}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with count_all_gathered_bytes() as counted:
            getattr(dist, names[0])(torch.empty(8), torch.ones(8))
        assert counted == [8 * 4]
        assert {n: getattr(dist, n) for n in names} == reals
        with pytest.raises(RuntimeError, match="planned"), count_all_gathered_bytes():
            raise RuntimeError("planned")
        assert {n: getattr(dist, n) for n in names} == reals
    finally:
        dist.destroy_process_group()
