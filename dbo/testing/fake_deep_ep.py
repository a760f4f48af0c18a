"""A test double of ``deep_ep`` for CPU tests: DeepEP's ``Buffer`` (normal and low-latency modes)
with the real Python signatures, handles and return shapes, moving CPU tensors over a gloo
process group with ``torch.distributed``, the module facade (:func:`make_fake_deep_ep`,
:func:`install_fake_deep_ep`, :func:`ensure_fake_deep_ep`), and our DeepEP backends built on it
(:func:`fake_deepep_backend`, :func:`fake_deepep_case_backend`).

This module holds the normal mode; the low-latency mode is :mod:`dbo.testing.fake_deep_ep_ll`,
the v2 buffers :mod:`dbo.testing.fake_deep_ep_v2`, and what they share
:mod:`dbo.testing.fake_deep_ep_core` (each imports only the core).

Inject it in tests only (never in library code)::

    with install_fake_deep_ep("v1"):      # sys.modules["deep_ep"] is the fake
        pf = deepep_ht.make_prepare_finalize(group, ...)

What it models, besides the data movement:

* streams: DeepEP's own comm stream is a :class:`dbo.ubatch.streams.LogicalStream`; a kernel waits on
  ``previous_event`` (else on the current stream), and without ``async_finish`` the current
  stream waits for it; ``allocate_on_comm_stream`` needs ``previous_event`` and
  ``async_finish``, as in DeepEP's C++ checks;
* low-latency receive buffers: two slots; each launch uses one and cleans the other, so a
  receive (hook) that runs after its slot was reused or cleaned raises
  :class:`FakeDeepEPError` (on a GPU it would hang or read garbage); output tensors hold NaN
  until their receive ran;
* DeepEP's input checks, as :class:`FakeDeepEPError` (the real one raises from C++ asserts).

Where the fake differs: only this rank's column of ``rank_prefix_matrix`` is filled and the
receive-side channel matrix is zero; normal-mode received rows are in (source rank, token)
order (DeepEP's order is the same for intranode); the fake is synchronous (gloo), so
``async_finish`` only changes stream bookkeeping.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from dbo.testing import fake_deep_ep_v2 as v2
from dbo.testing.fake_deep_ep_core import (
    Config,
    EventHandle,
    EventOverlap,
    FakeBufferBase,
    FakeDeepEPError,
    Kernel,
    check,
    exchange_rows,
    fill_garbage,
    from_bytes,
    to_bytes,
    topk_idx_t,
)
from dbo.testing.fake_deep_ep_ll import LLSlots, ll_combine, ll_dispatch

__all__ = [
    "FakeDeepEPError",
    "EventHandle",
    "EventOverlap",
    "Config",
    "Buffer",
    "topk_idx_t",
    "make_fake_deep_ep",
    "install_fake_deep_ep",
    "ensure_fake_deep_ep",
    "fake_deepep_backend",
    "fake_deepep_case_backend",
    "exchange_rows",
    "to_bytes",
    "from_bytes",
    "fill_garbage",
]


# ---- the v1 Buffer ------------------------------------------------------------------------


class Buffer(FakeBufferBase):
    """Fake of ``deep_ep.Buffer`` (v1.2.1 signatures) on CPU tensors and a gloo group."""

    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None) -> None:
        check(group is not None, "Either 'group' or 'comm' must be provided.")
        self.rank = group.rank()
        self._init_base(group, explicitly_destroy, f"deep_ep.comm.r{self.rank}")
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.nvshmem_qp_depth = 1024
        self.ll_slots = LLSlots()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        check(new_num_sms % 2 == 0, "The SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        per_msg = 16 + hidden * 2 + hidden // 128 * 4
        return 2 * (num_experts * num_max_dispatch_tokens_per_rank * per_msg * 2 + num_experts * 4)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        check(num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160),
              f"Unsupported number of EP ranks: {num_ranks}")
        return Config(Buffer.num_sms, 24 if num_ranks == 2 else 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        check(num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160),
              f"Unsupported number of EP ranks: {num_ranks}")
        return Config(Buffer.num_sms, 10 if num_ranks == 2 else 4, 256, 6, 128)

    # ---- normal mode ---------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple:
        self._alive("get_dispatch_layout", dict(previous_event=previous_event is not None,
                                                async_finish=async_finish))
        check(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx must be 2-D contiguous")
        check(topk_idx.dtype == topk_idx_t, f"topk_idx must be {topk_idx_t}, got {topk_idx.dtype}")
        check(num_experts > 0 and num_experts % self.group_size == 0, "bad num_experts")
        k = Kernel(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        n_local = num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // n_local, torch.full_like(topk_idx, -1))
        is_token_in_rank = torch.zeros((topk_idx.shape[0], self.group_size), dtype=torch.bool)
        for r in range(self.group_size):
            is_token_in_rank[:, r] = (rank_of == r).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return (num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, k.finish())

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        self._alive("dispatch", dict(previous_event=previous_event is not None, async_finish=async_finish))
        check(handle is None, "cached dispatch (handle=...) is not modelled by the fake")
        check(num_worst_tokens == 0, "num_worst_tokens is not modelled by the fake")
        check(num_tokens_per_rank is not None and is_token_in_rank is not None
              and num_tokens_per_expert is not None, "layout tensors are required")
        config = self.get_dispatch_config(self.group_size) if config is None else config
        check(config.num_sms % 2 == 0, "config.num_sms must be even")
        x, scales = x if isinstance(x, tuple) else (x, None)
        check(x.dim() == 2 and x.is_contiguous(), "x must be 2-D contiguous")
        check((x.shape[1] * x.element_size()) % 16 == 0, "hidden bytes must be a multiple of 16")
        check(is_token_in_rank.dtype == torch.bool and tuple(is_token_in_rank.shape)
              == (x.shape[0], self.group_size), "is_token_in_rank must be [num_tokens, num_ranks] bool")
        check(num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_rank.dtype == torch.int32,
              "layout counts must be int32")
        check((topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights go together")
        if scales is not None:
            check(x.element_size() == 1 and scales.dtype in (torch.float32, torch.int32)
                  and scales.dim() == 2 and scales.shape[0] == x.shape[0], "bad fp8 scales")
        num_experts = num_tokens_per_expert.shape[0]
        n_local = num_experts // self.group_size
        num_topk = 0
        if topk_idx is not None:
            check(topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous(), "bad topk_idx")
            check(topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(),
                  "topk_weights must be contiguous float32")
            num_topk = topk_idx.shape[1]
        k = Kernel(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        t = x.shape[0]
        parts = [to_bytes(x)]
        if scales is not None:
            parts.append(to_bytes(scales.float() if scales.dtype == torch.float32 else scales))
        if topk_idx is not None:
            parts += [to_bytes(topk_idx), to_bytes(topk_weights)]
        parts.append(to_bytes(torch.arange(t, dtype=torch.int32).unsqueeze(1)))
        rows = torch.cat(parts, dim=1)
        order = torch.cat([torch.nonzero(is_token_in_rank[:, r]).flatten()
                           for r in range(self.group_size)]) if t else torch.empty(0, dtype=torch.long)
        send_counts = is_token_in_rank.sum(0).tolist()
        recv, recv_counts = exchange_rows(self.group, rows[order], send_counts)
        n = recv.shape[0]
        widths = [p.shape[1] for p in parts]
        cols = torch.split(recv, widths, dim=1)
        recv_x = from_bytes(cols[0], x.dtype, (x.shape[1],))
        i = 1
        recv_scales = None
        if scales is not None:
            recv_scales = from_bytes(cols[1], scales.dtype, (scales.shape[1],))
            i = 2
        recv_topk_idx = recv_topk_weights = None
        counts_list: list[int] = []
        if topk_idx is not None:
            gidx = from_bytes(cols[i], torch.int64, (num_topk,))
            w = from_bytes(cols[i + 1], torch.float32, (num_topk,))
            lo = self.rank * n_local
            local = (gidx >= lo) & (gidx < lo + n_local)
            recv_topk_idx = torch.where(local, gidx - lo, torch.full_like(gidx, -1))
            recv_topk_weights = torch.where(local, w, torch.zeros_like(w))
            counts = torch.bincount(recv_topk_idx[local], minlength=n_local).tolist()
            counts_list = [-(-c // expert_alignment) * expert_alignment for c in counts]
        recv_src_idx = from_bytes(cols[-1], torch.int32, (1,)).flatten().contiguous()
        rpm = torch.zeros((self.group_size, self.group_size), dtype=torch.int32)
        rpm[:, self.rank] = torch.tensor(recv_counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        channels = config.num_sms // 2
        chunk = -(-t // channels) if t else 1
        chan = (torch.arange(t) // chunk).clamp(max=channels - 1)
        cpm = torch.zeros((self.group_size, channels), dtype=torch.int32)
        for r in range(self.group_size):
            sent = chan[is_token_in_rank[:, r]]
            cpm[r] = torch.bincount(sent, minlength=channels)[:channels].cumsum(0).to(torch.int32)
        send_head = torch.where(is_token_in_rank, is_token_in_rank.to(torch.int32).cumsum(0) - 1,
                                torch.full_like(is_token_in_rank, -1, dtype=torch.int32))
        handle = (rpm, cpm, torch.zeros_like(cpm), recv_src_idx, is_token_in_rank,
                  send_head.to(torch.int32).contiguous())
        assert recv_x.shape[0] == n
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        return (out_x, recv_topk_idx, recv_topk_weights, counts_list, handle,
                k.finish((recv_x, recv_src_idx)))

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        self._alive("combine", dict(previous_event=previous_event is not None, async_finish=async_finish))
        check(bias is None, "bias is not modelled by the fake")
        check(x.dim() == 2 and x.is_contiguous(), "x must be 2-D contiguous")
        check(x.dtype == torch.bfloat16, f"normal-mode combine supports bf16 only, got {x.dtype}")
        rpm, _cpm, _rcpm, src_idx, is_token_in_rank, send_head = handle
        check(src_idx.shape[0] == x.shape[0], "x rows must match the dispatch's received rows")
        if topk_weights is not None:
            check(topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
                  and topk_weights.shape[0] == x.shape[0], "bad topk_weights")
        k = Kernel(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        col = rpm[:, self.rank].tolist()
        recv_from = [col[0]] + [col[i] - col[i - 1] for i in range(1, len(col))]
        parts = [to_bytes(x)] + ([to_bytes(topk_weights)] if topk_weights is not None else [])
        rows = torch.cat(parts, dim=1)
        back, _ = exchange_rows(self.group, rows, recv_from, is_token_in_rank.sum(0).tolist())
        t, hidden = is_token_in_rank.shape[0], x.shape[1]
        acc = torch.zeros((t, hidden), dtype=torch.float32)
        wacc = (torch.zeros((t, topk_weights.shape[1]), dtype=torch.float32)
                if topk_weights is not None else None)
        start = 0
        for r in range(self.group_size):
            idx = torch.nonzero(is_token_in_rank[:, r]).flatten()
            block = back[start:start + idx.numel()]
            start += idx.numel()
            acc.index_add_(0, idx, from_bytes(block[:, : hidden * 2], torch.bfloat16, (hidden,)).float())
            if wacc is not None:
                wacc.index_add_(0, idx, from_bytes(block[:, hidden * 2:], torch.float32, (wacc.shape[1],)))
        combined = acc.to(torch.bfloat16)
        return combined, wacc, k.finish((x, combined))

    # ---- low-latency mode ----------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self._alive("clean_low_latency_buffer", {})
        self.ll_slots = LLSlots(seq=self.ll_slots.seq)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        self._alive("low_latency_dispatch", dict(use_fp8=use_fp8, async_finish=async_finish,
                                                 return_recv_hook=return_recv_hook))
        return ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                           cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                           async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple:
        self._alive("low_latency_combine", dict(async_finish=async_finish,
                                                return_recv_hook=return_recv_hook))
        check(not use_logfmt and not zero_copy, "use_logfmt/zero_copy are not modelled by the fake")
        return ll_combine(self, x, topk_idx, topk_weights, handle, async_finish, return_recv_hook, out)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        raise FakeDeepEPError("fake deep_ep: get_local_buffer_tensor is not modelled")


# ---- the module ---------------------------------------------------------------------------


def make_fake_deep_ep(api: str = "v1") -> types.ModuleType:
    """A module that looks like ``deep_ep``.

    ``api``: ``"v1"`` (the tokenspeed-deepep 1.2.1 wheel: ``Buffer``), ``"v2-elastic"`` (DeepEP
    2.1: ``Buffer`` and ``ElasticBuffer``) or ``"v2-ep"`` (newer: ``Buffer`` and ``EPBuffer``).
    """
    mod = types.ModuleType("deep_ep")
    mod.__dict__.update(Buffer=Buffer, Config=Config, EventOverlap=EventOverlap,
                        EventHandle=EventHandle, topk_idx_t=topk_idx_t, FAKE=True)
    if api == "v1":
        mod.__version__ = "1.2.1"
    elif api in ("v2-elastic", "v2-ep"):
        mod.__version__ = "2.1.0"
        mod.EPHandle = v2.EPHandle
        if api == "v2-elastic":
            mod.ElasticBuffer = v2.ElasticBuffer
        else:
            mod.EPBuffer = v2.EPBuffer
    else:
        raise ValueError(f"api must be 'v1', 'v2-elastic' or 'v2-ep', got {api!r}")
    return mod


@contextlib.contextmanager
def install_fake_deep_ep(api: str = "v1") -> Iterator[types.ModuleType]:
    """Put the fake in ``sys.modules["deep_ep"]`` for the ``with`` block (tests only)."""
    mod = make_fake_deep_ep(api)
    missing = object()
    old = sys.modules.get("deep_ep", missing)
    sys.modules["deep_ep"] = mod
    try:
        yield mod
    finally:
        if old is missing:
            sys.modules.pop("deep_ep", None)
        else:
            sys.modules["deep_ep"] = old


def ensure_fake_deep_ep(api: str = "v1") -> types.ModuleType:
    """For test worker processes: make ``sys.modules["deep_ep"]`` the fake of ``api`` for the
    rest of the process, and drop the DeepEP buffers made with another one."""
    mod = sys.modules.get("deep_ep")
    if mod is None or getattr(mod, "FAKE_API", None) != api:
        from dbo.backends.deepep.buffer import BUFFER_CACHE

        mod = make_fake_deep_ep(api)
        mod.FAKE_API = api
        sys.modules["deep_ep"] = mod
        BUFFER_CACHE.reset()
    return mod


# ---- our backends on the fake -------------------------------------------------------------

#: the DeepEP backends by the kind the tests name them with
DEEPEP_BACKEND_MODULES = {"ht": "dbo.backends.deepep_ht", "ll": "dbo.backends.deepep_ll",
                          "v2": "dbo.backends.deepep_v2"}


def fake_deepep_backend(kind: str, *, api: str = "v1", **options: Any) -> Any:
    """Our ``deepep_<kind>`` backend (``kind``: ``"ht"``, ``"ll"`` or ``"v2"``) over the default
    process group, on the fake ``deep_ep`` of ``api`` (made this process's by
    :func:`ensure_fake_deep_ep`). ``options``: the backend's ``make_prepare_finalize`` keywords
    (``hidden``, ``num_experts``, ``topk``, ``dtype``, ``device``, ...)."""
    import importlib

    import torch.distributed as dist

    if kind not in DEEPEP_BACKEND_MODULES:
        raise ValueError(f"kind must be one of {sorted(DEEPEP_BACKEND_MODULES)}, got {kind!r}")
    ensure_fake_deep_ep(api)
    mod = importlib.import_module(DEEPEP_BACKEND_MODULES[kind])
    return mod.make_prepare_finalize(dist.group.WORLD, **options)


def fake_deepep_case_backend(case: Any, kind: str | None = None) -> Any:
    """A :mod:`dbo.testing.conformance` factory: :func:`fake_deepep_backend` on CPU with the
    case's shapes. ``case.options`` may name the ``backend`` kind (else ``kind``) and the
    fake's ``api`` (default ``"v1"``); the rest are the backend's keywords."""
    opts = dict(case.options)
    kind = opts.pop("backend", kind)
    return fake_deepep_backend(kind, api=opts.pop("api", "v1"), hidden=case.hidden,
                               max_tokens_per_rank=case.max_tokens_per_rank,
                               num_experts=case.num_experts, topk=case.topk, dtype=case.dtype,
                               device="cpu", **opts)
