"""The benchmark's expert kernels on a GPU (``dbo.bench`` uses the library's experts): the Triton
gather-reduce against float32, and the experts under the MoE kernel, as the benchmark drives them,
against a float32 reference (run on the GPU host: ``pytest tests/gpu/test_bench_kernels_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from dbo.moe import ActivationFormat, MoEKernel, SwiGLUExperts, relative_error, topk_route
from dbo.moe.gather_reduce import HAVE_TRITON, gather_reduce
from dbo.moe.local import LocalPrepareAndFinalize
from dbo.moe.reference import reference_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("m, p, topk, hidden", [(1, 1, 1, 128), (4097, 9000, 8, 7168), (300, 700, 6, 1000)])
def test_triton_gather_reduce_matches_float32(m, p, topk, hidden):
    assert HAVE_TRITON, "triton is not importable on this GPU host"
    g = torch.Generator(device="cuda").manual_seed(m + p)
    y = torch.randn(p, hidden, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, p, (m, topk), device="cuda", generator=g)
    w = torch.rand(m, topk, device="cuda", generator=g)
    local = w >= 0.4
    out = gather_reduce(y, pos, w, local)
    ref = (y.float()[pos] * torch.where(local, w, 0)[..., None]).sum(1)
    assert out.dtype == torch.bfloat16 and out.shape == (m, hidden)
    assert relative_error(out.float(), ref) < 1e-2


@pytest.mark.parametrize("fmt", [ActivationFormat.STANDARD, ActivationFormat.BATCHED_EXPERTS])
@pytest.mark.parametrize("reduce_in_experts", [True, False])
def test_library_experts_bf16_match_reference(fmt, reduce_in_experts):
    g = torch.Generator(device="cuda").manual_seed(int(reduce_in_experts))
    m, hidden, inter, experts, topk = 512, 1024, 256, 16, 4
    x = torch.randn(m, hidden, device="cuda", generator=g)
    w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter ** 0.5
    weights, ids = topk_route(torch.randn(m, experts, device="cuda", generator=g), topk)
    ids[:, -1] = -1  # every token has a slot routed nowhere
    ref = reference_moe(x, w1, w2, weights, ids)
    kernel = MoEKernel(LocalPrepareAndFinalize(fmt, use_async=False),
                       SwiGLUExperts(reduce_in_experts=reduce_in_experts))
    out = kernel(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), weights, ids, global_num_experts=experts)
    assert relative_error(out.float(), ref) < 2e-2
