"""The benchmark's experts before they moved into the library (``ChunkedSwiGLUExperts`` of
``examples/_bench_layer.py`` at commit 7592bcb, STANDARD format, one chunk, gather reduction),
frozen here as the baseline that ``compare_experts.py`` times the library's experts against.
Not used anywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dbo.moe import ActivationFormat, MoEExperts, TopKWeightAndReduceNoOp

_grouped_mm = getattr(torch, "_grouped_mm", None)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _old_gather_reduce_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, hidden,
                                  TOPK: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            w = tl.load(w_ptr + m * TOPK + s)
            if w != 0.0:
                row = tl.load(pos_ptr + m * TOPK + s).to(tl.int64)
                acc += w * tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _old_gather_reduce(y, pos, weights):
    m, topk = pos.shape
    hidden = y.shape[1]
    if triton is None or not y.is_cuda:
        return F.embedding_bag(pos, y, mode="sum", per_sample_weights=weights.to(y.dtype))
    out = torch.empty(m, hidden, dtype=y.dtype, device=y.device)
    if m:
        block = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
        _old_gather_reduce_kernel[(m, triton.cdiv(hidden, block))](
            y.contiguous(), pos.contiguous(), weights.float().contiguous(), out, hidden,
            TOPK=topk, BLOCK=block)
    return out


class OldChunkedSwiGLUExperts(MoEExperts):
    """The old benchmark experts (one chunk): host-side counts (read back, a sync, when the
    backend has none), two ``torch._grouped_mm``, ``silu(gate) * up``, Triton gather-reduce."""

    def supported_activation_formats(self):
        return (ActivationFormat.STANDARD,)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, *, activation_format,
              expert_tokens_meta, apply_router_weight_on_input, workspace):
        x = hidden_states
        m, hidden = x.shape
        n_local = w1.shape[0]
        topk = topk_ids.shape[1]
        key = topk_ids.reshape(-1).to(torch.int64)
        key = torch.where(key >= 0, key, n_local)
        sorted_key, order = torch.sort(key, stable=True)
        meta = expert_tokens_meta
        if meta is not None and meta.expert_num_tokens_cpu is not None:
            counts = [int(c) for c in meta.expert_num_tokens_cpu.tolist()]
        else:
            ends = torch.searchsorted(sorted_key, torch.arange(1, n_local + 1, device=x.device))
            counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        total = sum(counts)
        if total == 0:
            return torch.zeros(m, hidden, dtype=x.dtype, device=x.device)
        pairs = order[:total]
        tokens = pairs // topk
        xs = x.index_select(0, tokens)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        offs = torch.tensor(starts[1:], dtype=torch.int32).pin_memory().to(x.device, non_blocking=True)
        h = _grouped_mm(xs, w1.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
        flat = m * topk
        pos = torch.zeros(flat, dtype=torch.int64, device=x.device)
        pos[pairs] = torch.arange(total, device=x.device)
        weights = torch.zeros(flat, dtype=torch.float32, device=x.device)
        weights[pairs] = topk_weights.reshape(-1).index_select(0, pairs).float()
        return _old_gather_reduce(y, pos.view(m, topk), weights.view(m, topk))
