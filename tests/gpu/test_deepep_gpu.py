"""GPU tests of the DeepEP backends: runs ``tests/gpu/run_deepep.py`` under torchrun on 2 GPUs.

Skipped where there are fewer than 2 CUDA devices or no ``deep_ep``. The full matrix (both
backends, hidden 2048 and 7168, top-k 1..8) runs with ``DBO_GPU_FULL=1``; otherwise
``--quick``. On the GPU host: ``pytest tests/gpu -m gpu``, or run the
script directly (see its docstring).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.deepep, pytest.mark.multiproc]

SCRIPT = Path(__file__).with_name("run_deepep.py")


@pytest.mark.timeout(1800)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs deep_ep")
def test_deepep_backends_on_two_gpus():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)]
    if not os.environ.get("DBO_GPU_FULL"):
        cmd.append("--quick")
    proc = subprocess.run(cmd, cwd=SCRIPT.parents[2], capture_output=True, text=True, timeout=1700)
    print(proc.stdout[-20000:])
    print(proc.stderr[-5000:], file=sys.stderr)
    assert proc.returncode == 0, f"run_deepep.py failed (exit {proc.returncode}); see the table above"
