"""The merged expert schedule's segments on the GPU (dbo.experts.kernels.batched, dbo.moe.merged):
the compiled order and row-copy kernels against plain indexing, and the library's merged path
(merge, SwiGLUExperts on the fused kernels, split) against one call per ubatch, with no host
sync and under CUDA graph capture, bf16 and fp8 with DeepEP's column-major scales. Run on the
GPU host: ``pytest tests/gpu/test_segments_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from dbo.bench.syncs import no_host_syncs
from dbo.experts import SwiGLUExperts, relative_error
from dbo.experts.kernels.batched import batched_order, batched_swiglu_experts, segment_bases
from dbo.experts.swiglu import dequantize_blocks, swiglu_expert
from dbo.kernels.row_copies import copy_arrived_rows
from dbo.moe import ActivationFormat, ExpertTokensMetadata, Workspace
from dbo.moe.merged import ExpertsInput, run_merged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BATCHED = ActivationFormat.BATCHED_EXPERTS
CASES = [  # (local experts, caps per ubatch)
    (8, (64, 64)), (3, (40, 17, 96)), (32, (128, 128)), (1, (5, 9, 2, 30)),
]


def _counts(n_local: int, caps, g: torch.Generator) -> list[torch.Tensor]:
    out = []
    for cap in caps:
        c = torch.randint(0, cap + 1, (n_local,), generator=g, device="cuda", dtype=torch.int32)
        c[0] = cap  # a full slab
        if n_local > 1:
            c[-1] = 0  # an expert without rows
        out.append(c)
    return out


@pytest.mark.parametrize("n_local,caps", CASES)
def test_order_and_copy_kernels_equal_plain_indexing(n_local, caps):
    g = torch.Generator(device="cuda").manual_seed(n_local)
    counts = _counts(n_local, caps, g)
    bases = segment_bases(n_local, caps)
    order, offsets = batched_order(torch.stack(counts, 1), caps)
    host = [c.tolist() for c in counts]
    want = [bases[u] + e * caps[u] + j for e in range(n_local) for u in range(len(caps))
            for j in range(host[u][e])]
    assert order[:len(want)].tolist() == want
    ends = torch.tensor([sum(h[e] for h in host) for e in range(n_local)]).cumsum(0)
    assert offsets.tolist() == ends.tolist()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for cap, c in zip(caps, host, strict=True):
            x = torch.randn(n_local, cap, 7168, device="cuda", generator=g).to(dtype)
            src = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided, as DeepEP's scales are
            dst = torch.zeros_like(x)
            copy_arrived_rows(src, dst, torch.tensor(c, device="cuda"))
            for e, n in enumerate(c):
                assert torch.equal(dst[e, :n].view(torch.uint8), x[e, :n].view(torch.uint8))
                assert not dst[e, n:].view(torch.uint8).any()


def _inputs(n_local: int, caps, hidden: int, fp8: bool, g: torch.Generator) -> list[ExpertsInput]:
    out = []
    for cap, c in zip(caps, _counts(n_local, caps, g), strict=True):
        x = torch.randn(n_local, cap, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
        scale = None
        if fp8:
            x = x.to(torch.float8_e4m3fn)
            # DeepEP low-latency's scales: [L, cap, hidden / 128], column-major in the last two
            scale = torch.rand(n_local, hidden // 128, cap, device="cuda", generator=g) + 0.5
            scale = scale.transpose(1, 2)
        ids = torch.zeros(cap // 2 + 1, 8, dtype=torch.int64, device="cuda")
        out.append(ExpertsInput(x, scale, ExpertTokensMetadata(c), ids, None))
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n_local,caps", CASES)
def test_merged_path_on_segments_equals_one_call_per_ubatch(n_local, caps, fp8):
    hidden, inter = 1024, 256
    g = torch.Generator(device="cuda").manual_seed(7)
    inputs = _inputs(n_local, caps, hidden, fp8, g)
    kw = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(n_local, 2 * inter, hidden, **kw) / hidden ** 0.5
    w2 = torch.randn(n_local, hidden, inter, **kw) / inter ** 0.5
    experts = SwiGLUExperts()
    assert experts.accepts_batched_segments(inputs[0].a1q)
    ws = Workspace()

    def compute(m: ExpertsInput) -> torch.Tensor:
        kw = {} if m.a1q_scale is None else {"a1q_scale": m.a1q_scale}
        return experts.apply(m.a1q, w1, w2, None, m.topk_ids, activation_format=BATCHED,
                             expert_tokens_meta=m.expert_tokens_meta,
                             apply_router_weight_on_input=False, workspace=ws, **kw)

    run_merged(BATCHED, inputs, compute, segmented=True)  # compiles
    with no_host_syncs():
        got = run_merged(BATCHED, inputs, compute, segmented=True)
    got = [t.clone() for t in got]
    # captured in a CUDA graph and replayed: the same rows
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_merged(BATCHED, inputs, compute, segmented=True)
    graph.replay()
    torch.cuda.synchronize()
    for u, inp in enumerate(inputs):
        x = dequantize_blocks(inp.a1q, inp.a1q_scale, torch.bfloat16)
        alone = batched_swiglu_experts(x, w1, w2, inp.expert_tokens_meta.expert_num_tokens,
                                       out=torch.empty_like(x))
        for e, c in enumerate(inp.expert_tokens_meta.expert_num_tokens.tolist()):
            if not c:
                continue
            ref = swiglu_expert(x[e, :c].double(), w1[e].double(), w2[e].double())
            assert relative_error(got[u][e, :c], alone[e, :c]) <= 1e-2, (u, e)
            assert relative_error(got[u][e, :c], ref) <= 1e-2, (u, e)
            assert relative_error(captured[u][e, :c], got[u][e, :c]) <= 1e-3, (u, e)
