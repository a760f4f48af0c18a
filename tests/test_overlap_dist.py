"""The overlapped forward of the demo's MoE model (dbo.bench.overlap.model) over a 2-rank gloo group,
with the naive and all2all backends: DBO output == plain output, for even and uneven token
counts, an empty rank, and the fallback when a rank is below its threshold; and the trace shows
the other ubatch running while a ubatch's dispatch is in flight."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

def _overlap_job(backend: str, tokens: list[int], dtype_name: str, threshold: int) -> dict:
    import torch
    import torch.distributed as dist

    import dbo
    from dbo.backends import make_backend
    from dbo.bench.overlap.model import BenchModel, LayerDims
    from dbo.experts import SwiGLUExperts, relative_error
    from dbo.overlap import DBOWrapper
    from dbo.split import FALLBACK_LOG, SplitConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    dims = LayerDims(hidden=32, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                     attn_width=64, layers=2, dtype=dtype, attn_yield=True)
    pf = make_backend(backend, None, hidden=dims.hidden, num_experts=dims.num_experts,
                      topk=dims.topk, max_tokens_per_rank=max(tokens), dtype=dtype, device="cpu")
    model = BenchModel(dims, rank, world, torch.device("cpu"), seed=3).use(pf, SwiGLUExperts())
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens[rank], dims.hidden, generator=g).to(dtype)
    FALLBACK_LOG.reset()
    wrapper = DBOWrapper(model, SplitConfig(prefill_token_threshold=threshold, adaptive=False))
    trace = dbo.Trace()
    with torch.inference_mode():
        ref = model(x)
        out = wrapper(x, trace=trace)
    plan = wrapper.last_plan
    result = {
        "rel": relative_error(out, ref) if tokens[rank] else 0.0,
        "shape_ok": out.shape == ref.shape and out.dtype == ref.dtype,
        "split": plan.split,
        "reason": plan.reason.value,
        "padded": plan.padded_size,
        "events": [(e.kind, e.ubatch, e.detail) for e in trace.events],
    }
    FALLBACK_LOG.reset()
    return result


def _other_ran_during_dispatch(events: list[tuple]) -> bool:
    """Ubatch 1 was resumed between ubatch 0's first dispatch and its receive."""
    start = events.index(("region_begin", 0, "dispatch"))
    end = events.index(("region_begin", 0, "dispatch_recv"))
    return ("resume", 1, "") in events[start:end]


CASES = [
    # backend, tokens per rank, dtype
    ("naive", [48, 48], "float32"),
    ("naive", [48, 0], "float32"),
    ("all2all", [48, 27], "float32"),
    ("all2all", [0, 33], "float32"),
    ("all2all", [40, 40], "bfloat16"),
]


@pytest.mark.parametrize("backend, tokens, dtype", CASES)
def test_overlapped_moe_equals_plain(world2, backend, tokens, dtype):
    results = world2.run(_overlap_job, backend, tokens, dtype, 0, timeout_s=90)
    limit = 1e-5 if dtype == "float32" else 2e-2
    for rank, r in enumerate(results):
        assert r["shape_ok"], f"rank {rank}"
        assert r["split"], f"rank {rank}: {r['reason']}"
        assert r["rel"] <= limit, f"rank {rank}: relative error {r['rel']:.3e}"
        assert _other_ran_during_dispatch(r["events"]), f"rank {rank}: no overlap"
    assert results[0]["padded"] == results[1]["padded"] == (max(tokens) + 1) // 2


def test_rank_below_threshold_falls_back_everywhere(world2):
    results = world2.run(_overlap_job, "naive", [48, 8], "float32", 16, timeout_s=90)
    assert [r["split"] for r in results] == [False, False]
    assert [r["reason"] for r in results] == ["disagreement", "below_threshold"]
    assert all(r["rel"] == 0.0 and r["events"] == [] for r in results)
