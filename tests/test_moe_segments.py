"""The merged expert schedule on BATCHED_EXPERTS slabs as segments of one flat buffer
(dbo.moe.merged, dbo.experts.kernels.batched): the merge lays the ubatches' slabs end to end with
only the rows that arrived, the experts write each row's output in place, and each ubatch's
output is a view of its region. Checked in plain torch here against separate per-ubatch calls
and the plain forward, and under Triton's interpreter (the fused kernels, the row copy and the
probe's code path) in a subprocess."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dbo
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.expert_schedule import use_expert_schedule
from dbo.experts import SwiGLUExperts, make_expert_weights, relative_error
from dbo.experts.kernels.batched import batched_order
from dbo.kernels.row_copies import copy_arrived_rows
from dbo.moe import ActivationFormat, ExpertTokensMetadata, MoEKernel, Workspace, topk_route
from dbo.moe.base import MAX_SEGMENTS, BatchedSegments
from dbo.moe.merged import ExpertsInput, merge_inputs, run_merged

BATCHED = ActivationFormat.BATCHED_EXPERTS
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _slab_inputs(n_local: int, caps: list[int], counts: list[list[int]], hidden: int, seed: int,
                 scales: bool = False, topk: int = 2) -> list[ExpertsInput]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for cap, c in zip(caps, counts, strict=True):
        meta = ExpertTokensMetadata(torch.tensor(c, dtype=torch.int32))
        scale = torch.rand(n_local, cap, 2, generator=g) + 0.5 if scales else None
        ids = torch.zeros(max(1, cap // 2), topk, dtype=torch.int64)
        out.append(ExpertsInput(torch.randn(n_local, cap, hidden, generator=g), scale, meta, ids, None))
    return out


@st.composite
def _segments(draw, max_ubatches: int = 3, max_cap: int = 6):
    n_local = draw(st.integers(1, 4), label="local experts")
    n = draw(st.integers(2, max_ubatches), label="ubatches")
    caps = draw(st.lists(st.integers(0, max_cap), min_size=n, max_size=n), label="caps")
    # counts from none to the full slab (the kernels clamp one past it)
    counts = [draw(st.lists(st.integers(0, cap), min_size=n_local, max_size=n_local), label=f"counts[{u}]")
              for u, cap in enumerate(caps)]
    return n_local, caps, counts


# ---- the merge -----------------------------------------------------------------------------


@settings(deadline=None)
@given(case=_segments(max_ubatches=MAX_SEGMENTS), scales=st.booleans(), seed=st.integers(0, 99))
def test_segmented_merge_lays_the_slabs_end_to_end(case, scales, seed):
    n_local, caps, counts = case
    inputs = _slab_inputs(n_local, caps, counts, 3, seed, scales)
    merged, split = merge_inputs(BATCHED, inputs, segmented=True)
    seg = merged.expert_tokens_meta.segments
    bases = [n_local * sum(caps[:u]) for u in range(len(caps) + 1)]
    assert seg.caps == tuple(caps) and seg.bases == tuple(bases)
    assert seg.counts.tolist() == [list(r) for r in zip(*counts, strict=True)]
    assert merged.expert_tokens_meta.expert_num_tokens.tolist() == [sum(r) for r in zip(*counts, strict=True)]
    assert merged.expert_tokens_meta.expert_num_tokens.dtype == torch.int32
    assert merged.a1q.shape == (bases[-1], 3)
    assert merged.topk_ids.shape[0] == sum(i.topk_ids.shape[0] for i in inputs)
    parts = split(merged.a1q)
    for u, (inp, part) in enumerate(zip(inputs, parts, strict=True)):
        region = merged.a1q[bases[u]:bases[u + 1]].view(n_local, caps[u], 3)
        assert part.shape == inp.a1q.shape
        if part.numel():  # a view of its region: nothing is copied back
            assert part.data_ptr() == region.data_ptr()
        for e, c in enumerate(counts[u]):
            assert torch.equal(region[e, :c], inp.a1q[e, :c])
            if scales:
                s = merged.a1q_scale[bases[u]:bases[u + 1]].view(n_local, caps[u], 2)
                assert torch.equal(s[e, :c], inp.a1q_scale[e, :c])
    assert (merged.a1q_scale is None) == (not scales)


def test_more_ubatches_than_segments_are_packed():
    n = MAX_SEGMENTS + 1
    inputs = _slab_inputs(2, [3] * n, [[1, 3]] * n, 4, seed=0)
    merged, split = merge_inputs(BATCHED, inputs, segmented=True)
    assert merged.expert_tokens_meta.segments is None and merged.a1q.shape == (2, 3 * n, 4)
    assert torch.equal(merged.a1q[1, :3 * n], torch.cat([i.a1q[1] for i in inputs]))
    # the default is the packed slab at any count
    merged, _ = merge_inputs(BATCHED, inputs[:2])
    assert merged.expert_tokens_meta.segments is None and merged.a1q.shape == (2, 6, 4)


def test_segments_and_the_order_reject_bad_shapes():
    with pytest.raises(ValueError, match=r"\[L, U\]"):
        BatchedSegments(torch.zeros(3, 2, dtype=torch.int32), (4,))
    with pytest.raises(ValueError, match="caps must be >= 0"):
        BatchedSegments(torch.zeros(3, 1, dtype=torch.int32), (-1,))
    counts = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int cap"):
        batched_order(counts, 4)
    with pytest.raises(ValueError, match="int cap"):
        batched_order(counts[:, 0], (4,))
    with pytest.raises(ValueError, match="segments with a cap each"):
        batched_order(counts, (4, 4, 4))
    with pytest.raises(ValueError, match="segments with a cap each"):
        batched_order(torch.zeros(3, MAX_SEGMENTS + 1, dtype=torch.int32), (1,) * (MAX_SEGMENTS + 1))
    with pytest.raises(ValueError, match="a row in all"):
        batched_order(counts, (0, 0))
    with pytest.raises(ValueError, match="overflow int32"):
        batched_order(counts, (2**30, 1))
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_arrived_rows(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4), counts[:2, 0])
    with pytest.raises(ValueError, match="2 experts"):
        copy_arrived_rows(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), counts[:, 0])


def test_copy_without_triton_copies_at_least_the_rows_that_arrived():
    src = torch.randn(3, 5, 4)
    dst = torch.zeros(3, 5, 4)
    copy_arrived_rows(src, dst, torch.tensor([0, 2, 5]), use_triton=False)
    assert torch.equal(dst[1, :2], src[1, :2]) and torch.equal(dst[2], src[2])


# ---- the experts on segments, without Triton ---------------------------------------------------


@settings(deadline=None, max_examples=30)
@given(case=_segments(), seed=st.integers(0, 99))
def test_experts_on_segments_equal_one_call_per_ubatch(case, seed):
    # without Triton SwiGLUExperts runs segments one slab at a time; each region of its output
    # holds that ubatch's rows as a call on the ubatch's own slab gives them
    n_local, caps, counts = case
    inputs = _slab_inputs(n_local, caps, counts, 8, seed)
    w1, w2 = make_expert_weights(n_local, 8, 4, seed=seed)
    experts = SwiGLUExperts(use_triton=False)
    assert not experts.accepts_batched_segments(inputs[0].a1q)

    def compute(m: ExpertsInput) -> torch.Tensor:
        return experts.apply(m.a1q, w1, w2, None, m.topk_ids, activation_format=BATCHED,
                             expert_tokens_meta=m.expert_tokens_meta,
                             apply_router_weight_on_input=False, workspace=Workspace())

    got = run_merged(BATCHED, inputs, compute, segmented=True)
    packed = run_merged(BATCHED, inputs, compute)
    for u, inp in enumerate(inputs):
        alone = compute(inp)
        for e, c in enumerate(counts[u]):
            if c:
                assert relative_error(got[u][e, :c], alone[e, :c]) <= 1e-6
                assert relative_error(packed[u][e, :c], alone[e, :c]) <= 1e-6


def test_segments_are_checked_against_the_activations():
    seg = BatchedSegments(torch.ones(2, 2, dtype=torch.int32), (3, 4))
    w1, w2 = make_expert_weights(2, 8, 4)
    with pytest.raises(ValueError, match=r"\[L \* sum\(caps\), hidden\]"):
        SwiGLUExperts().apply(torch.zeros(2, 7, 8), w1, w2, None, None, activation_format=BATCHED,
                              expert_tokens_meta=ExpertTokensMetadata(seg.counts.sum(1), None, seg),
                              apply_router_weight_on_input=False, workspace=Workspace())


# ---- the merged schedule, end to end ---------------------------------------------------------


class _SegmentExperts(SwiGLUExperts):
    """SwiGLUExperts that take segments on the CPU (their per-slab path) and count the calls
    that got them."""

    def __init__(self) -> None:
        super().__init__(use_triton=False)
        self.segmented_calls = 0

    def accepts_batched_segments(self, hidden_states: torch.Tensor) -> bool:
        return True

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, *, expert_tokens_meta, **kw):
        self.segmented_calls += expert_tokens_meta.segments is not None
        return super().apply(hidden_states, w1, w2, topk_weights, topk_ids,
                             expert_tokens_meta=expert_tokens_meta, **kw)


@dataclasses.dataclass
class _Model:
    kernels: list[MoEKernel]
    w1: torch.Tensor
    w2: torch.Tensor
    mix: torch.Tensor
    fail_ubatch: int | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.kernels:
            a = torch.tanh(x @ self.mix)
            if dbo.dbo_enabled() and dbo.dbo_current_ubatch_id() == self.fail_ubatch:
                raise ValueError("boom")
            w, ids = topk_route(a @ self.mix[:, : self.w1.shape[0]], 2)
            x = x + k(a, self.w1, self.w2, w, ids, global_num_experts=self.w1.shape[0])
        return x


def _model(experts_cls, layers: int = 2, n_local: int = 5, hidden: int = 16) -> _Model:
    w1, w2 = make_expert_weights(n_local, hidden, 8, seed=3)
    mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(4)) / hidden ** 0.5
    kernels = [MoEKernel(LocalPrepareAndFinalize(BATCHED), experts_cls()) for _ in range(layers)]
    return _Model(kernels, w1, w2, mix)


@pytest.mark.parametrize("sizes", [(7, 5), (4, 9, 6)])
def test_merged_schedule_on_segments_equals_the_plain_forward(sizes):
    model = _model(_SegmentExperts)
    x = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(5))
    plain = model(x)
    parts = list(x.split(list(sizes)))
    for schedule in ("split", "merged"):
        with use_expert_schedule(schedule):
            got = torch.cat(dbo.run_ubatches([lambda p=p: model(p) for p in parts], device="cpu"))
        assert relative_error(got, plain) <= 1e-5, schedule
    # one merged call per layer took segments (the split schedule's calls got none)
    assert [k.experts.segmented_calls for k in model.kernels] == [1, 1]
    assert all(len(k._rendezvous) == 0 for k in model.kernels)


def test_a_failing_ubatch_leaves_no_segmented_rendezvous_behind():
    model = _model(_SegmentExperts)
    model.fail_ubatch = 1
    parts = list(torch.randn(12, 16).split([6, 6]))
    with use_expert_schedule("merged"), pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches([lambda p=p: model(p) for p in parts], device="cpu")
    assert info.value.ubatch_id == 1
    assert all(len(k._rendezvous) == 0 for k in model.kernels)


# ---- under Triton's interpreter ---------------------------------------------------------------


_SCRIPT = r"""
import functools
import importlib.util
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dbo
from dbo.expert_schedule import use_expert_schedule
from dbo.moe import ActivationFormat, ExpertTokensMetadata, MoEKernel, Workspace, topk_route
from dbo.backends.local import LocalPrepareAndFinalize
from dbo.experts import SwiGLUExperts, make_expert_weights, relative_error
from dbo.moe import merged as merged_mod
from dbo.experts.swiglu import dequantize_blocks, swiglu_expert
from dbo.experts.kernels import batched
from dbo.experts.kernels.batched import (
    batched_order,
    batched_swiglu_experts,
    segment_bases,
    segmented_swiglu_experts,
)
from dbo.kernels.row_copies import copy_arrived_rows

BATCHED = ActivationFormat.BATCHED_EXPERTS
examples, derandomize = int(sys.argv[1]), sys.argv[2] == "1"
# the merge's row copy on the CPU is plain torch by default: here the Triton kernel runs it
merged_mod.copy_arrived_rows = functools.partial(copy_arrived_rows, use_triton=True)
HIDDEN, INTER = 32, 16


@st.composite
def cases(draw):
    n_local = draw(st.integers(1, 5))
    n = draw(st.integers(2, 3))
    caps = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    counts = [[draw(st.sampled_from([0, cap, cap + 2]) | st.integers(0, cap)) for _ in range(n_local)]
              for cap in caps]
    return n_local, caps, counts, draw(st.booleans()), draw(st.integers(0, 999))


@settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None)
@given(case=cases())
def check(case):
    n_local, caps, counts, fp8, seed = case
    g = torch.Generator().manual_seed(seed)
    bases = segment_bases(n_local, caps)
    clamped = [[min(c, cap) for c in cs] for cap, cs in zip(caps, counts)]
    seg_counts = torch.tensor(counts, dtype=torch.int32).t().contiguous()
    # the order: expert e's rows of ubatch 0, then ubatch 1's, ...; offsets the running totals
    order, offsets = batched_order(seg_counts, caps)
    want = [bases[u] + e * caps[u] + j for e in range(n_local) for u in range(len(caps))
            for j in range(clamped[u][e])]
    assert order[:len(want)].tolist() == want, (order, want)
    ends = torch.tensor([sum(clamped[u][e] for u in range(len(caps))) for e in range(n_local)]).cumsum(0)
    assert offsets.tolist() == ends.tolist()
    # the row copy: the rows that arrived, the others untouched (fp8 as bytes, strided sources)
    xs = [torch.randn(n_local, cap, HIDDEN, generator=g) for cap in caps]
    if fp8:
        xs = [x.to(torch.float8_e4m3fn) for x in xs]
    for x, raw, cs in zip(xs, counts, clamped):
        src = x.transpose(1, 2).contiguous().transpose(1, 2)
        dst = torch.zeros_like(x)
        copy_arrived_rows(src, dst, torch.tensor(raw), use_triton=True)
        for e, c in enumerate(cs):
            assert torch.equal(dst[e, :c].view(torch.uint8), x[e, :c].view(torch.uint8))
            assert not dst[e, c:].view(torch.uint8).any()
    # the experts once over the segments, against one call per ubatch and one expert at a time
    w1, w2 = make_expert_weights(n_local, HIDDEN, INTER, seed=seed)
    xf = [x.float() for x in xs]
    flat = torch.cat([x.reshape(-1, HIDDEN) for x in xf])
    out = torch.full_like(flat, float("nan"))
    segmented_swiglu_experts(flat, w1, w2, seg_counts, caps, out=out)
    for u, (x, cs) in enumerate(zip(xf, clamped)):
        alone = batched_swiglu_experts(x, w1, w2, torch.tensor(counts[u]), out=torch.empty_like(x))
        region = out[bases[u]:bases[u + 1]].view(n_local, caps[u], HIDDEN)
        for e, c in enumerate(cs):
            assert bool(region[e, c:].isnan().all()), (u, e)  # rows that did not arrive: unwritten
            if c:
                ref = swiglu_expert(x[e, :c].double(), w1[e].double(), w2[e].double()).float()
                assert relative_error(region[e, :c], alone[e, :c]) <= 1e-5, (u, e)
                assert relative_error(region[e, :c], ref) <= 1e-5, (u, e)
    # the library's merged path (merge, SwiGLUExperts on the fused kernels, split), fp8 with
    # its scales, against each ubatch's rows computed alone
    experts = SwiGLUExperts(use_triton=True)
    assert experts.accepts_batched_segments(xs[0])
    scales = [torch.rand(n_local, cap, 1, generator=g) + 0.5 for cap in caps] if fp8 else [None] * len(caps)
    inputs = [merged_mod.ExpertsInput(x, s, ExpertTokensMetadata(torch.tensor(cs, dtype=torch.int32)),
                                      torch.zeros(2, 2, dtype=torch.int64), None)
              for x, s, cs in zip(xs, scales, counts)]

    def compute(m):
        kw = {} if m.a1q_scale is None else {"a1q_scale": m.a1q_scale}
        return experts.apply(m.a1q, w1, w2, None, m.topk_ids, activation_format=BATCHED,
                             expert_tokens_meta=m.expert_tokens_meta,
                             apply_router_weight_on_input=False, workspace=Workspace(), **kw)

    got = merged_mod.run_merged(BATCHED, inputs, compute, segmented=True)
    for u, (inp, cs) in enumerate(zip(inputs, clamped)):
        x = dequantize_blocks(inp.a1q, inp.a1q_scale, torch.float32)
        for e, c in enumerate(cs):
            if c:
                ref = swiglu_expert(x[e, :c].double(), w1[e].double(), w2[e].double()).float()
                assert relative_error(got[u][e, :c], ref) <= 1e-5, (u, e)


check()

# the merged schedule through MoEKernel on the fused kernels, against the plain forward
w1, w2 = make_expert_weights(4, HIDDEN, INTER, seed=1)
mix = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(2)) / HIDDEN ** 0.5
kernels = [MoEKernel(LocalPrepareAndFinalize(BATCHED), SwiGLUExperts(use_triton=True)) for _ in range(2)]
calls = []
segmented = batched.segmented_swiglu_experts
def counted(*a, **k):
    calls.append(1)
    return segmented(*a, **k)
import dbo.experts.swiglu as experts_mod
experts_mod.segmented_swiglu_experts = counted

def model(x):
    for k in kernels:
        a = torch.tanh(x @ mix)
        w, ids = topk_route(a @ mix[:, :4], 2)
        x = x + k(a, w1, w2, w, ids, global_num_experts=4)
    return x

x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(3))
plain = model(x)
with use_expert_schedule("merged"):
    got = torch.cat(dbo.run_ubatches([lambda p=p: model(p) for p in x.split([6, 5])], device="cpu"))
assert relative_error(got, plain) <= 1e-5, relative_error(got, plain)
assert len(calls) == 2, calls

# the probe's callables (tools/probes/batched_experts.py), as the GPU runs them
spec = importlib.util.spec_from_file_location("batched_probe", "tools/probes/batched_experts.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
fns, case = probe.runners(16, 3, 8, 2, hidden=32, topk=2, device="cpu", dtype=torch.float32)
for f in fns.values():
    f()
assert case["segmented"] and probe.merged_vs_split(fns, case) <= 1e-5
print("ok")
"""


@pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
@pytest.mark.timeout(600)
def test_segments_on_the_fused_kernels_in_the_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the interpreter is slow: a fifth of the profile's examples, derandomized as it is
    current = settings()
    examples = max(4, current.max_examples // 5)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(examples), str(int(current.derandomize))],
                          cwd=root, capture_output=True, text=True, timeout=580,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
