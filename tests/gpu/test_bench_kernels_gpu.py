"""The benchmark's expert kernels on a GPU (``dbo.bench`` uses the library's experts): the Triton
gather-reduce against float32, and the experts under the MoE kernel, as the benchmark drives them,
against a float32 reference (run on the GPU host: ``pytest tests/gpu/test_bench_kernels_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from dbo.backends.local import LocalPrepareAndFinalize
from dbo.experts import SwiGLUExperts, relative_error
from dbo.experts.kernels.gather_reduce import gather_reduce
from dbo.experts.reference import reference_moe
from dbo.kernels.triton_launch import HAVE_TRITON
from dbo.moe import ActivationFormat, MoEKernel, topk_route

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


def test_experts_benchmark_times_the_gpu_and_an_isolated_call():
    from dbo.bench.experts.command import IDLE_SUFFIX, make_case, time_experts

    case = make_case(256, 1024, 256, 8, num_experts=64, topk=4)
    impls = {"lib": (SwiGLUExperts(num_global_experts=64), False),
             "unfused": (SwiGLUExperts(fused=False), False)}
    res = time_experts(impls, case, steps=5)
    assert set(res) == {"lib", "unfused", "lib" + IDLE_SUFFIX, "unfused" + IDLE_SUFFIX}
    for name, r in res.items():
        assert r["median_ms"] > 0 and r["host_ms"] > 0, name
    # the same implementation timed both ways computes the same output; the two agree closely
    assert res["lib" + IDLE_SUFFIX]["rel_err"] == res["lib"]["rel_err"] == 0.0
    assert res["unfused"]["rel_err"] < 2e-2


def test_limits_name_the_gpu_instance():
    from dbo.bench.limits import measure_device_limits

    lim = measure_device_limits(copy_bytes=64 << 20, gemm_n=1024, reps=3)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert lim.instance == f"GPU-{props.uuid}" and lim.as_dict()["instance"] == lim.instance
    assert lim.instance.count("-") == 5  # GPU- and the UUID's four dashes, as nvidia-smi prints it
