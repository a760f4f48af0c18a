"""The v2 half of the fake ``deep_ep``: ``ElasticBuffer`` (DeepEP 2.1) and ``EPBuffer`` (later)
with the signatures in ``tests/fixtures/deepep_v2_signatures.json``, and ``EPHandle``.

Semantics modelled (from DeepEP's ``tests/elastic/test_ep.py`` and ``deep_ep/utils/refs.py``):

* non-expand dispatch: one row per received token, in (source rank, token) order;
  ``recv_topk_idx`` holds LOCAL ids (``-1`` elsewhere). Without ``do_cpu_sync`` the receive
  tensors have the worst-case ``num_ranks * num_max_tokens_per_rank`` rows and the rows past
  ``psum_num_recv_tokens_per_scaleup_rank[-1]`` are garbage (NaN tokens, random in-range ids);
  ``num_recv_tokens_per_expert_list`` is then not valid (the fake fills it with -1);
* expand dispatch: one row per (token, local expert), grouped by expert, each expert's block
  starting at an ``expert_alignment``-aligned row; ``recv_topk_idx`` is None and
  ``recv_topk_weights`` is 1-D; ``recv_src_metadata[:, 2:]`` holds each slot's row (``-1``);
* combine sums, without weights, every row a token was sent to (expand mode: every slot row)
  back on the token's rank, accumulating in float32;
* ``previous_event`` requires ``allocate_on_comm_stream`` (v2's documented rule); EPBuffer
  rejects ``do_handle_copy=True``. Cached dispatch (``handle=``) and ``defer_epilogue`` are not
  modelled.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.testing.fake_deep_ep_core import (
    EventHandle,
    FakeBufferBase,
    Kernel,
    check,
    exchange_rows,
    fill_garbage,
    from_bytes,
    to_bytes,
    topk_idx_t,
)

__all__ = ["EPHandle", "ElasticBuffer", "EPBuffer"]


class EPHandle:
    """``deep_ep.EPHandle``: the layout of one dispatch, consumed by combine."""

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx: torch.Tensor,
                 num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: torch.Tensor | None,
                 channel_linked_list: torch.Tensor | None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list


def _kwargs(local_vars: dict) -> dict:
    kw = dict(local_vars)
    kw.pop("self", None)
    kw.pop("__class__", None)
    return kw


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


class _V2Base(FakeBufferBase):
    """The shared implementation; subclasses only fix the public signatures."""

    def _setup(self, group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
               use_fp8_dispatch: bool, explicitly_destroy: bool) -> None:
        self.rank_idx = group.rank()
        self._init_base(group, explicitly_destroy, f"deep_ep.v2.comm.r{self.rank_idx}")
        self.num_ranks = group.size()
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args: Any, **kwargs: Any) -> int:
        return 24

    def _dispatch(self, kwargs: dict) -> tuple:
        self._alive("dispatch", {"previous_event": kwargs["previous_event"] is not None})
        x = kwargs["x"]
        topk_idx, topk_weights = kwargs["topk_idx"], kwargs["topk_weights"]
        check(kwargs["handle"] is None, "cached dispatch is not modelled by the fake")
        check(kwargs.get("defer_epilogue", False) is False, "defer_epilogue is not modelled by the fake")
        previous_event = kwargs["previous_event"]
        if previous_event is not None:
            check(kwargs["allocate_on_comm_stream"], "previous_event needs allocate_on_comm_stream=True")
        num_experts = kwargs["num_experts"]
        max_tokens = kwargs["num_max_tokens_per_rank"] or self.num_max_tokens_per_rank
        align = kwargs["expert_alignment"] or 1
        do_cpu_sync = True if kwargs["do_cpu_sync"] is None else kwargs["do_cpu_sync"]
        expand = kwargs["do_expand"]
        x, sf = x if isinstance(x, tuple) else (x, None)
        check(x.dim() == 2 and x.is_contiguous(), "x must be 2-D contiguous")
        check(x.dtype in (torch.bfloat16, torch.float8_e4m3fn), f"x must be bf16 or fp8, got {x.dtype}")
        check(topk_idx is not None and topk_idx.dtype == topk_idx_t and topk_idx.dim() == 2,
              "topk_idx must be [num_tokens, num_topk] int64")
        check(topk_weights is None or (topk_weights.dtype == torch.float32
                                        and topk_weights.shape == topk_idx.shape), "bad topk_weights")
        check(x.shape[0] <= max_tokens, f"{x.shape[0]} tokens > num_max_tokens_per_rank {max_tokens}")
        check(num_experts is not None and num_experts % self.num_ranks == 0, "bad num_experts")
        kernel = Kernel(self.comm_stream, previous_event, kwargs["async_with_compute_stream"],
                         False)
        r, me = self.num_ranks, self.rank_idx
        n_local = num_experts // r
        t, k = topk_idx.shape
        hidden = x.shape[1]
        weights = topk_weights if topk_weights is not None else torch.zeros(t, k)
        parts = [to_bytes(x)] + ([to_bytes(sf)] if sf is not None else [])
        parts += [to_bytes(topk_idx), to_bytes(weights),
                  to_bytes((me * max_tokens + torch.arange(t, dtype=torch.int32)).unsqueeze(1))]
        rows = torch.cat(parts, dim=1)
        dest = torch.where(topk_idx >= 0, topk_idx // n_local, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(dest == j).any(dim=1) for j in range(r)], dim=1) if t else \
            torch.zeros((0, r), dtype=torch.bool)
        order = torch.cat([torch.nonzero(in_rank[:, j]).flatten() for j in range(r)])
        recv, recv_counts = exchange_rows(self.group, rows[order], in_rank.sum(0).tolist())
        cols = torch.split(recv, [p.shape[1] for p in parts], dim=1)
        n = recv.shape[0]
        rx = from_bytes(cols[0], x.dtype, (hidden,))
        rsf = from_bytes(cols[1], sf.dtype, (sf.shape[1],)) if sf is not None else None
        o = 2 if sf is not None else 1
        gidx = from_bytes(cols[o], torch.int64, (k,))
        rw = from_bytes(cols[o + 1], torch.float32, (k,))
        src = from_bytes(cols[o + 2], torch.int32, (1,)).flatten()
        local = (gidx >= me * n_local) & (gidx < (me + 1) * n_local)
        lidx = torch.where(local, gidx - me * n_local, torch.full_like(gidx, -1))
        unaligned = torch.bincount(lidx[local], minlength=n_local)
        psum_rank = torch.tensor(recv_counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        metadata = torch.full((n, 2 + k), -1, dtype=torch.int32)
        metadata[:, 0] = src
        metadata[:, 1] = torch.arange(n, dtype=torch.int32)
        if not expand:
            cap = n if do_cpu_sync else r * max_tokens
            out_x = fill_garbage(torch.empty((cap, hidden), dtype=x.dtype))
            out_x[:n] = rx
            out_sf = None
            if rsf is not None:
                out_sf = fill_garbage(torch.empty((cap, rsf.shape[1]), dtype=rsf.dtype))
                out_sf[:n] = rsf
            out_ids = torch.randint(0, n_local, (cap, k), dtype=torch.int64)
            out_ids[:n] = lidx
            out_w = torch.rand((cap, k), dtype=torch.float32)
            out_w[:n] = rw
            aligned = [_align(c, align) for c in unaligned.tolist()]
            psum_expert = torch.tensor(aligned, dtype=torch.int32).cumsum(0).to(torch.int32)
            counts_list = aligned if do_cpu_sync else [-1] * n_local
            num_expanded = cap
            result_x: Any = (out_x, out_sf) if out_sf is not None else out_x
            result_ids: Any = out_ids
        else:
            starts, psum, pos = [], [], 0
            for c in unaligned.tolist():
                start = _align(pos, align)
                starts.append(start)
                psum.append(start + c)
                pos = start + c
            total = _align(pos, align) if n_local else 0
            cap = total if do_cpu_sync else r * max_tokens * min(k, n_local) + n_local * align
            out_x = fill_garbage(torch.empty((cap, hidden), dtype=x.dtype))
            out_sf = (fill_garbage(torch.empty((cap, rsf.shape[1]), dtype=rsf.dtype))
                      if rsf is not None else None)
            out_w = fill_garbage(torch.empty((cap,), dtype=torch.float32))
            if kwargs["do_zero_padding"]:
                out_x.zero_()
                out_w.zero_()
                if out_sf is not None:
                    out_sf.zero_()
            fill = list(starts)
            for row in range(n):
                for j in range(k):
                    e = int(lidx[row, j])
                    if e < 0:
                        continue
                    slot = fill[e]
                    fill[e] += 1
                    out_x[slot] = rx[row]
                    if out_sf is not None:
                        out_sf[slot] = rsf[row]
                    out_w[slot] = rw[row, j]
                    metadata[row, 2 + j] = slot
            psum_expert = torch.tensor(psum, dtype=torch.int32)
            counts_list = ([_align(c, align) for c in unaligned.tolist()] if do_cpu_sync
                           else [-1] * n_local)
            num_expanded = cap
            result_x = (out_x, out_sf) if out_sf is not None else out_x
            result_ids = None
        handle = EPHandle(expand, num_experts, align, max_tokens, 24, topk_idx, n, num_expanded,
                          counts_list, psum_rank, psum_expert, unaligned.to(torch.int32), metadata,
                          torch.arange(n, dtype=torch.int32), None, None)
        handle._send_in_rank = in_rank
        return result_x, result_ids, out_w, handle, kernel.finish((out_x,))

    def _combine(self, kwargs: dict) -> tuple:
        self._alive("combine", {"previous_event": kwargs["previous_event"] is not None})
        x, handle = kwargs["x"], kwargs["handle"]
        check(kwargs["bias"] is None, "bias is not modelled by the fake")
        check(kwargs.get("defer_epilogue", False) is False, "defer_epilogue is not modelled by the fake")
        previous_event = kwargs["previous_event"]
        if previous_event is not None:
            check(kwargs["allocate_on_comm_stream"], "previous_event needs allocate_on_comm_stream=True")
        check(x.dim() == 2 and x.dtype == torch.bfloat16, f"combine takes 2-D bf16, got {x.dtype}")
        kernel = Kernel(self.comm_stream, previous_event, kwargs["async_with_compute_stream"], False)
        n = handle.num_recv_tokens
        meta = handle.recv_src_metadata
        hidden = x.shape[1]
        if handle.do_expand:
            slots = meta[:, 2:].to(torch.long)
            acc = torch.zeros((n, hidden), dtype=torch.float32)
            for j in range(slots.shape[1]):
                valid = slots[:, j] >= 0
                acc[valid] += x[slots[valid, j]].float()
            y = acc.to(torch.bfloat16)
        else:
            check(x.shape[0] >= n, "x has fewer rows than were received")
            y = x[:n]
        src = meta[:, 0].to(torch.long)
        in_rank = handle._send_in_rank
        recv_from = torch.diff(handle.psum_num_recv_tokens_per_scaleup_rank.to(torch.long),
                               prepend=torch.zeros(1, dtype=torch.long)).tolist()
        rows = torch.cat([to_bytes(y), to_bytes(src.to(torch.int64).unsqueeze(1))], dim=1)
        back, _ = exchange_rows(self.group, rows, recv_from, in_rank.sum(0).tolist())
        t = handle.topk_idx.shape[0]
        acc = torch.zeros((t, hidden), dtype=torch.float32)
        tok = from_bytes(back[:, hidden * 2:], torch.int64, (1,)).flatten() % handle.num_max_tokens_per_rank
        acc.index_add_(0, tok, from_bytes(back[:, : hidden * 2], torch.bfloat16, (hidden,)).float())
        combined = acc.to(torch.bfloat16)
        return combined, None, kernel.finish((x, combined))


class ElasticBuffer(_V2Base):
    """Fake of ``deep_ep.ElasticBuffer`` (DeepEP 2.1.0 signatures)."""

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        self._setup(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    explicitly_destroy)

    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: EventHandle | None = None,
                 previous_event_before_epilogue: EventHandle | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False) -> tuple:
        return self._dispatch(_kwargs(locals()))

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: EventHandle | None = None,
                previous_event_before_epilogue: EventHandle | None = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        return self._combine(_kwargs(locals()))


class EPBuffer(_V2Base):
    """Fake of ``deep_ep.EPBuffer`` (the signatures after the ElasticBuffer split)."""

    def __init__(self, group: Any, num_bytes: int | None = None, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: Any = 0, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int | None = None,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        self._setup(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    explicitly_destroy)

    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: EventHandle | None = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None,
                 do_handle_copy: bool = False, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False, defer_epilogue: bool = False) -> tuple:
        check(not do_handle_copy, "`do_handle_copy` must be False")
        return self._dispatch(_kwargs(locals()))

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: EventHandle | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, defer_epilogue: bool = False) -> tuple:
        return self._combine(_kwargs(locals()))
