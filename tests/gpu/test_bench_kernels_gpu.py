"""The benchmark's expert kernels on a GPU: the Triton gather-reduce and the chunked experts
against a float32 reference (run on the GPU host: ``pytest tests/gpu/test_bench_kernels_gpu.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import _bench_layer as bl  # noqa: E402 - examples/ is not a package

from dbo.moe import ActivationFormat, MoEKernel, relative_error, topk_route  # noqa: E402
from dbo.moe.local import LocalPrepareAndFinalize  # noqa: E402
from dbo.moe.reference import reference_moe  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("m, p, topk, hidden", [(1, 1, 1, 128), (4097, 9000, 8, 7168), (300, 700, 6, 1000)])
def test_triton_gather_reduce_matches_float32(m, p, topk, hidden):
    assert bl.triton is not None, "triton is not importable on this GPU host"
    g = torch.Generator(device="cuda").manual_seed(m + p)
    y = torch.randn(p, hidden, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, p, (m, topk), device="cuda", generator=g)
    w = torch.rand(m, topk, device="cuda", generator=g)
    w[w < 0.4] = 0
    out = bl.gather_reduce(y, pos, w)
    ref = (y.float()[pos] * w[..., None]).sum(1)
    assert out.dtype == torch.bfloat16 and out.shape == (m, hidden)
    assert relative_error(out.float(), ref) < 1e-2


@pytest.mark.parametrize("reduce", ["gather", "index_add"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_chunked_experts_bf16_match_reference(reduce, chunks):
    g = torch.Generator(device="cuda").manual_seed(chunks)
    m, hidden, inter, experts, topk = 512, 1024, 256, 16, 4
    x = torch.randn(m, hidden, device="cuda", generator=g)
    w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter ** 0.5
    weights, ids = topk_route(torch.randn(m, experts, device="cuda", generator=g), topk)
    ids[:, -1] = -1  # every token has a slot routed nowhere
    ref = reference_moe(x, w1, w2, weights, ids)
    kernel = MoEKernel(LocalPrepareAndFinalize(ActivationFormat.STANDARD, use_async=False),
                       bl.ChunkedSwiGLUExperts(chunks, reduce=reduce))
    out = kernel(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), weights, ids,
                 global_num_experts=experts)
    assert relative_error(out.float(), ref) < 2e-2
