"""The BATCHED_EXPERTS layout's kernels (dbo.experts.kernels.batched): the row order and the experts
over the rows that arrived (Triton's interpreter, against one expert at a time), and the row
move of the merged schedule (plain torch and Triton), against plain indexing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from dbo.kernels.row_copies import move_rows

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _rows(n: int, limit: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randperm(limit, generator=g)[:n]
    dst = torch.randperm(limit, generator=g)[:n]
    src[torch.rand(n, generator=g) < 0.3] = -1
    dst[torch.rand(n, generator=g) < 0.2] = -1
    return src, dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_rows_copies_the_pairs_whose_indices_are_both_set(dtype):
    src = torch.randn(3, 10, 6).to(dtype)
    dst = torch.full((2, 20, 6), 7.0, dtype=dtype)
    s, d = _rows(25, 30, seed=1)
    s = s.clamp(max=29)
    d = d.clamp(max=39)
    want = dst.clone().view(-1, 6)
    for i, j in zip(s.tolist(), d.tolist(), strict=True):
        if i >= 0 and j >= 0:
            want[j] = src.view(-1, 6)[i]
    got = move_rows(src, dst, s, d, row_dims=2, use_triton=False)
    assert got is dst and torch.equal(dst.view(-1, 6), want)


def test_move_rows_rejects_rows_of_another_width():
    with pytest.raises(ValueError, match="cannot go to rows"):
        move_rows(torch.zeros(4, 5), torch.zeros(4, 6), torch.zeros(2, dtype=torch.long),
                  torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="equal 1-D"):
        move_rows(torch.zeros(4, 5), torch.zeros(4, 5), torch.zeros(2, dtype=torch.long),
                  torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="row_dims"):
        move_rows(torch.zeros(4, 5), torch.zeros(4, 5), torch.zeros(2, dtype=torch.long),
                  torch.zeros(2, dtype=torch.long), row_dims=3)


_SCRIPT = r"""
import torch
from dbo.experts.swiglu import swiglu_expert
from dbo.experts.kernels.batched import batched_order, batched_swiglu_experts
from dbo.kernels.row_copies import move_rows
from dbo.experts.kernels.fused_experts import GemmConfig
from dbo.experts.reference import make_expert_weights

g = torch.Generator().manual_seed(0)
# the order: sorted row r of expert e is slab row e * cap + j, offsets the end rows (a count
# above the capacity is clamped, a zero count has no rows)
counts = torch.tensor([3, 0, 7, 5, 9], dtype=torch.int32)
order, offsets = batched_order(counts, 8)
want = [e * 8 + j for e, c in enumerate(counts.clamp(max=8).tolist()) for j in range(c)]
assert offsets.tolist() == [3, 3, 10, 15, 23], offsets
assert order[:23].tolist() == want, order
# the experts on the rows that arrived, each against one expert on its rows; rows past the
# counts are left as they were
for seed, (n_local, cap, hidden, inter, cfgs) in enumerate([
        (4, 24, 32, 16, None),
        (3, 40, 64, 32, (GemmConfig(32, 16, 16, 2, 4, 2, tma=True, tail_m=16),
                         GemmConfig(32, 16, 16, 2, 4, 2, flat=True))),
        (5, 16, 64, 32, (GemmConfig(16, 16, 16, 2, 4, 2),
                         GemmConfig(32, 16, 32, 2, 4, 2, n_per_program=2)))]):
    counts = torch.randint(0, cap + 1, (n_local,), generator=g).to(torch.int32)
    counts[0] = 0
    counts[-1] = cap
    x = torch.randn(n_local, cap, hidden, generator=g)
    w1, w2 = make_expert_weights(n_local, hidden, inter, seed=seed)
    dtype = torch.float32 if cfgs is None else torch.float16
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out = torch.full_like(x, float("nan"))
    batched_swiglu_experts(x, w1, w2, counts, out=out, configs=cfgs, persistent=seed != 1)
    for e, c in enumerate(counts.tolist()):
        want = swiglu_expert(x[e, :c].float(), w1[e].float(), w2[e].float())
        err = ((out[e, :c].float() - want).norm() / want.norm().clamp(min=1e-9)).item() if c else 0.0
        assert err < (1e-5 if dtype == torch.float32 else 3e-3), (seed, e, err)
        assert bool(out[e, c:].isnan().all()), (seed, e)
# the row move: the same bits as indexing, other rows untouched
src = torch.randn(3, 10, 40)
dst = torch.full((2, 20, 40), 7.0)
s = torch.tensor([0, 5, -1, 29, 7, 3])
d = torch.tensor([39, -1, 2, 0, 11, 12])
want = dst.clone().view(-1, 40)
for i, j in zip(s.tolist(), d.tolist()):
    if i >= 0 and j >= 0:
        want[j] = src.view(-1, 40)[i]
move_rows(src, dst, s, d, row_dims=2, use_triton=True)
assert torch.equal(dst.view(-1, 40), want)
print("ok")
"""


@pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
@pytest.mark.timeout(330)
def test_batched_kernels_in_the_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
