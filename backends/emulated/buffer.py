"""DeepEP's ``Buffer`` played by one device as rank ``r`` of an expert-parallel group of ``N``.

:class:`EmulatedBuffer` has the Python API of ``deep_ep.Buffer`` that dbo's DeepEP backends call
(normal mode: ``get_dispatch_layout``, ``dispatch``, ``combine``; low-latency mode:
``low_latency_dispatch`` and ``low_latency_combine`` with or without the recv hook; ``capture``,
the configs, ``clean_low_latency_buffer``, ``destroy``), so the real backends
(:mod:`dbo.backends.deepep_ht`, :mod:`dbo.backends.deepep_ll`) run on it unchanged: their host
waits, hooks, yields, stream hand-overs and CUDA-graph capture are the real ones.

What rank ``r`` receives. In a symmetric deployment under uniform routing, rank ``r`` receives
from each rank ``s`` about what it sends to ``s``. So the rows this rank's tokens send to rank
``s`` stand in for the rows ``s`` sends back: a (token, expert ``e``) pair arrives "from" rank
``s = e // L`` at local expert ``e % L`` (``L = num_experts / N`` local experts). Each local
expert then gets ``T * topk / L`` rows on average, the rows a real rank computes; the layouts
(low-latency slabs in (source rank, token) order with DeepEP's ``layout_range`` and
``src_info``; normal-mode rows with local top-k ids, ``-1`` elsewhere) are DeepEP's. The
combine returns each row to its stand-in token, so the layer's output is that of a MoE whose
token ``t`` uses local experts ``ids[t] % L`` with its router weights: the reference the tests
hold it to (:func:`dbo.moe.validate.stand_in_local_ids`).

The bytes. Every call moves, on this device's memory, what the rank's GPU moves: the send side
packs (the fp8 cast and scales of a low-latency dispatch, the rows per (token, expert) of a
low-latency combine, the token rows of a normal dispatch), the receive side unpacks into the
slabs or rows (and reduces, on combine). Between the two the arrival is held back by the link
(:class:`~dbo.backends.simulated_link.LinkServer`): the bytes that leave the host, counted on the
device from the routing (low-latency: one message per (token, expert) pair; normal mode: one per
(token, destination host), DeepEP's RDMA path), plus the call's fixed cost. The normal-mode
dispatch also waits on the host for the received counts, after the notify's fixed cost, as
DeepEP does.

Not modelled: what the peers do (incast, congestion, stragglers), routing skew, the SMs that
DeepEP's kernels and RDMA proxies hold for the whole transfer (the emulation's kernels hold SMs
only while they copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dbo.experts.kernels.gather_reduce import gather_reduce

from ..fp8 import FP8_BLOCK, quantize_fp8_blocks
from ..simulated_link import LinkServer, SimulatedLink
from . import kernels
from .streams import EventOverlap, StreamEvent, Streams

__all__ = ["EmulatedGroup", "EmulatedBuffer", "EmulatedConfig", "DISPATCH_PAIR_EXTRA_BYTES"]

#: bytes DeepEP's low-latency dispatch sends per (token, expert) besides the row and its scales
DISPATCH_PAIR_EXTRA_BYTES = 16


def _nothing() -> None:
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[M, H]`` as ``[M, H * itemsize]`` uint8 (a view)."""
    return t.view(torch.uint8)


@dataclass(frozen=True)
class EmulatedGroup:
    """The stand-in of rank ``rank`` in a group of ``size`` ranks, ``gpus_per_host`` a host: what
    the backends ask of a process group (``size()``, ``rank()``), and nothing else."""

    group_size: int
    group_rank: int = 0
    gpus_per_host: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.group_size, int) and self.group_size >= 2):
            raise ValueError(f"an emulated group has at least 2 ranks, got {self.group_size!r}")
        if not (isinstance(self.group_rank, int) and 0 <= self.group_rank < self.group_size):
            raise ValueError(f"rank must be in [0, {self.group_size}), got {self.group_rank!r}")
        if not (isinstance(self.gpus_per_host, int) and self.gpus_per_host >= 1):
            raise ValueError(f"gpus_per_host must be a positive int, got {self.gpus_per_host!r}")

    def size(self) -> int:
        return self.group_size

    def rank(self) -> int:
        return self.group_rank


class EmulatedConfig:
    """``deep_ep.Config``'s place: the SM count the normal kernels would use (kept, unused)."""

    def __init__(self, num_sms: int = 24):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # the emulation allocates what each call needs

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


# ---- the buffer ----------------------------------------------------------------------------


class EmulatedBuffer:
    """``deep_ep.Buffer`` for rank ``group.rank()`` of ``group.size()`` on ``device`` (see the
    module docstring). ``link``: the link the rank's off-host bytes cross (None: they arrive at
    once); ``remote_fraction``: the share of the bytes to other ranks that crosses it, where the
    group fits one host (None: counted from the hosts, ``gpus_per_host`` ranks each);
    ``imbalance``: the rank is the hottest one, receiving this many times a rank's mean (>= 1;
    low-latency mode): the extra pairs, copies of its own first pairs in turn, cross the link,
    fill the slabs and go back in the combine, and are not summed into its tokens."""

    #: no NVSHMEM queue pairs to run out of
    nvshmem_qp_depth = 1 << 30

    def __init__(self, group: EmulatedGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 1,
                 explicitly_destroy: bool = False, *, device: torch.device | str = "cpu",
                 link: SimulatedLink | None = None, remote_fraction: float | None = None,
                 imbalance: float = 1.0):
        if not isinstance(group, EmulatedGroup):
            raise TypeError(f"an EmulatedBuffer takes an EmulatedGroup, got {type(group).__name__}")
        del num_nvl_bytes, num_rdma_bytes, num_qps_per_rank
        self.group = group
        self.group_size, self.rank = group.size(), group.rank()
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.runtime: Any = object()
        self.device = torch.device(device)
        self.link = link
        self._server = LinkServer(link) if link is not None else None
        self.remote_fraction = remote_fraction
        if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not imbalance >= 1.0:
            raise ValueError(f"imbalance must be a number >= 1 (max / mean rows), got {imbalance!r}")
        if imbalance != 1.0 and not low_latency_mode:
            raise ValueError("imbalance is modelled for the low-latency layout only")
        self.imbalance = float(imbalance)
        self._streams = Streams(self.device)
        self._ll_slots: list[dict[str, torch.Tensor] | None] = [None, None]
        self._ll_next = 0
        self._ll_layout: tuple | None = None
        #: the last normal-mode layout counted on the device, for the dispatch that takes it
        self._ht_layout: kernels.HTLayout | None = None
        #: the notify's flow: no bytes (its fixed cost only)
        self._no_bytes = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._host = self.rank // group.gpus_per_host
        hosts = torch.arange(self.group_size) // group.gpus_per_host
        self._off_host = (hosts != self._host).to(self.device)  # [N] bool: rank s is on another host
        self._other_rank = (torch.arange(self.group_size) != self.rank).to(self.device)
        self._rank_host = hosts.to(self.device)
        self.num_hosts = int(hosts.max()) + 1
        #: per destination rank, the share of its bytes that crosses the link: the ranks of other
        #: hosts, or ``remote_fraction`` of every other rank's where it is given
        self.remote_share = (self._off_host.to(torch.float32) if remote_fraction is None
                             else self._other_rank.to(torch.float32) * remote_fraction)
        #: the same x 1024, as the flows count bytes (int64 ``[N]``)
        self.share_q = self._quantized(self.remote_share)
        if self.num_hosts > 1 and self.group_size % group.gpus_per_host:
            raise ValueError(f"a group of {self.group_size} ranks over hosts of {group.gpus_per_host} GPUs: "
                             "the group size must be a multiple of gpus_per_host")

    # ---- what every Buffer has -----------------------------------------------------------

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> EmulatedConfig:
        del num_ranks
        return EmulatedConfig()

    @staticmethod
    def get_combine_config(num_ranks: int) -> EmulatedConfig:
        del num_ranks
        return EmulatedConfig()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 0  # the emulation allocates its slabs on first use

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        del new_num_sms  # the emulation's copies use what the GPU gives them

    def capture(self) -> EventOverlap:
        """An event on the current stream (``Buffer.capture``)."""
        return EventOverlap(StreamEvent(self.device, self._streams.current()))

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError("`explicitly_destroy` flag must be set")
        self.runtime = None
        self._ll_slots = [None, None]

    def _check_alive(self) -> None:
        if self.runtime is None:
            raise RuntimeError("the emulated buffer was destroyed")

    # ---- the link ---------------------------------------------------------------------------

    def _hold(self, phase: str, units_q: torch.Tensor, unit_bytes: float, fixed_us: float | None = None,
              begun: torch.Tensor | None = None) -> Callable[[], None]:
        """Queue a flow of ``units_q / 1024 * unit_bytes`` bytes (``units_q``: a one-element int64
        tensor on the device, counted from the routing in 1/1024 units) ready at this point of the
        current stream; returns what its receiver calls first. ``fixed_us``: instead of the
        phase's fixed cost. ``begun``: where the call's first kernel stamped the GPU's global
        timer (:meth:`_stamp`): the NIC-like link counts the fixed cost from there."""
        if self._server is None:
            return _nothing
        start = self._server.start(self.device)
        return self._server.hold(start, self.device, phase, count=units_q,
                                 bytes_per_count=unit_bytes / 1024, fixed_us=fixed_us, begun=begun)

    def _stamp(self, fused: bool) -> torch.Tensor | None:
        """Where a fused send kernel stamps its start (``[1]`` int64), when a link holds the call:
        DeepEP's published times count a call from its kernels' start, its own work included,
        so the emulation's own work (routing, the cast, packing) is part of the modelled time, not
        added to it."""
        if not fused or self._server is None:
            return None
        return torch.empty(1, dtype=torch.int64, device=self.device)

    @staticmethod
    def _quantized(units: torch.Tensor) -> torch.Tensor:
        """``units`` ``[1]`` float32 as the flows count them: int64, in 1/1024 units."""
        return torch.round(units * 1024).to(torch.int64)

    def extra_pairs(self, pairs: int) -> int:
        """The pairs a rank of :attr:`imbalance` receives beyond ``pairs``, its own."""
        return round((self.imbalance - 1.0) * pairs)

    @staticmethod
    def _with_extra(topk_idx: torch.Tensor, extra: int) -> torch.Tensor:
        """``topk_idx``'s pairs and ``extra`` copies of its first ones in turn, ``[T * k + extra, 1]``."""
        ids = topk_idx.reshape(-1)
        if extra and ids.numel():
            ids = ids[torch.arange(ids.numel() + extra, device=ids.device) % ids.numel()]
        return ids.view(-1, 1)

    def remote_units(self, topk_idx: torch.Tensor, n_local: int, dest: torch.Tensor | None = None, *,
                     extra: int = 0, begun: torch.Tensor | None = None) -> torch.Tensor:
        """The (token, expert) pairs of ``topk_idx`` ``[T, k]`` (and ``extra`` copies of its first
        ones in turn) that leave the host, each weighted by its destination's share of bytes that
        cross the link, in 1/1024 units: ``[1]`` int64 (a low-latency call sends one message per
        pair). ``dest``: the pairs' destination ranks ``[T * k]``, where known. ``begun``: where
        the fused kernel stamps its start (:meth:`_stamp`)."""
        if dest is None and kernels.usable(topk_idx):
            return kernels.ll_remote_units(topk_idx, self.share_q, n_local, extra, begun=begun)
        if extra:
            topk_idx = self._with_extra(topk_idx, extra)
        if dest is None:
            dest = torch.div(topk_idx.clamp(min=0), n_local, rounding_mode="floor").reshape(-1)
        valid = topk_idx.reshape(-1) >= 0
        return torch.where(valid, self.share_q[dest], 0).sum().reshape(1)

    # ---- low-latency mode ---------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        del num_max_dispatch_tokens_per_rank, hidden, num_experts
        self._ll_slots = [None, None]
        self._ll_layout = None

    def _ll_slot(self, max_tokens: int, hidden: int, num_experts: int, use_fp8: bool
                 ) -> dict[str, torch.Tensor]:
        """The receive tensors of the next of the two low-latency slots (made on first use)."""
        layout = (max_tokens, hidden, num_experts)
        if self._ll_layout != layout:
            self._ll_slots, self._ll_layout = [None, None], layout
        idx = self._ll_next
        self._ll_next ^= 1
        slot = self._ll_slots[idx]
        if slot is None or ("scales" in slot) != use_fp8:
            n_local, cap = num_experts // self.group_size, self.group_size * max_tokens
            dev = self.device
            slot = {
                # one spare row at the end: the pairs with no expert (-1) land there
                "x": torch.empty((n_local * cap + 1, hidden),
                                 dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device=dev),
                "count": torch.zeros((n_local,), dtype=torch.int32, device=dev),
                "src_info": torch.zeros((n_local * cap + 1,), dtype=torch.int32, device=dev),
                "layout_range": torch.zeros((n_local, self.group_size), dtype=torch.int64, device=dev),
            }
            if use_fp8:
                slot["scales"] = torch.empty((n_local * cap + 1, hidden // FP8_BLOCK), dtype=torch.float32,
                                             device=dev)
            self._ll_slots[idx] = slot
        return slot

    def _slot_of(self, src_info: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The low-latency slot whose ``src_info`` the handle's is (None: a copy)."""
        ptr = src_info.untyped_storage().data_ptr()
        for slot in self._ll_slots:
            if slot is not None and slot["src_info"].untyped_storage().data_ptr() == ptr:
                return slot
        return None

    def pair_rows(self, topk_idx: torch.Tensor, num_experts: int, cap: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each (token, expert) pair lands in the slabs: its flat row ``le * cap + pos``
        (``L * cap`` for a pair with no expert), ``[T * k]`` int64; the pairs per (local expert,
        source rank), ``[L, N]`` int64; and the pairs' destination ranks, ``[T * k]`` int64."""
        n = self.group_size
        n_local = num_experts // n
        ids = topk_idx.reshape(-1)
        valid = ids >= 0
        safe = torch.where(valid, ids, 0)
        dest = torch.div(safe, n_local, rounding_mode="floor")
        key = torch.where(valid, torch.remainder(safe, n_local) * n + dest, n_local * n)
        per_key = torch.zeros(n_local * n + 1, dtype=torch.int64, device=ids.device)
        per_key.index_add_(0, key, torch.ones_like(key))
        order = torch.sort(key, stable=True).indices
        sorted_key = key[order]
        key_start = torch.cumsum(per_key, 0) - per_key  # first sorted index of each key
        expert_start = key_start[torch.div(sorted_key, n, rounding_mode="floor") * n]
        pos = torch.arange(ids.numel(), device=ids.device) - expert_start
        row_sorted = torch.where(sorted_key < n_local * n,
                                 torch.div(sorted_key, n, rounding_mode="floor") * cap + pos, n_local * cap)
        rows = torch.empty_like(row_sorted)
        rows[order] = row_sorted
        return rows, per_key[:-1].view(n_local, n), torch.where(valid, dest, self.rank)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        """DeepEP's low-latency dispatch of ``x`` ``[T, hidden]`` bf16 by ``topk_idx`` ``[T, k]``
        int64. Returns ``(recv_x, count, handle, event, hook)``: ``recv_x`` ``[L, N * M, hidden]``
        (fp8 with ``use_fp8``: ``(q, scales [L, N * M, hidden / 128] float32)``), valid in the
        first ``count[e]`` rows of each local expert once received (after ``hook()`` with
        ``return_recv_hook``, else after ``event``)."""
        self._check_alive()
        if round_scale or use_ue8m0:
            raise ValueError("the emulated buffer does not model round_scale / use_ue8m0")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other")
        t, k = topk_idx.shape
        hidden, max_tokens = x.shape[1], num_max_dispatch_tokens_per_rank
        if t > max_tokens:
            raise ValueError(f"{t} tokens for num_max_dispatch_tokens_per_rank={max_tokens}")
        n, n_local = self.group_size, num_experts // self.group_size
        cap = n * max_tokens
        slot = self._ll_slot(max_tokens, hidden, num_experts, use_fp8)
        streams = self._streams
        with streams.kernel(None, on_current=return_recv_hook) as stream:
            # the send: the fp8 cast once per token, where each pair lands, the bytes that leave
            pair_bytes = hidden * (1 if use_fp8 else 2) + (hidden // FP8_BLOCK * 4 if use_fp8 else 0) \
                + DISPATCH_PAIR_EXTRA_BYTES
            fused = kernels.usable(x)
            extra = self.extra_pairs(t * k)
            begun = self._stamp(fused)
            if fused:
                q, scales, rows, rows0, units = kernels.ll_send(
                    x, topk_idx, self.share_q, slot, n=n, n_local=n_local, cap=cap, use_fp8=use_fp8,
                    extra=extra, begun=begun)
            else:
                q, scales = quantize_fp8_blocks(x) if use_fp8 else (x, None)
                ids = self._with_extra(topk_idx, extra)
                rows, per_key, dest = self.pair_rows(ids, num_experts, cap)
                rows0 = torch.where(ids.reshape(-1) >= 0, rows, 0)
                units = self.remote_units(ids, n_local, dest)
                slot["count"].copy_(per_key.sum(1))
                begin = torch.cumsum(per_key, 1) - per_key
                slot["layout_range"].copy_((begin << 32) | per_key)
            # the combine of this dispatch finds its pairs' rows here (a group combine
            # masks whole experts' ids, which moves no other pair's row)
            slot["pair_rows"] = rows0
            held = self._hold("dispatch", units, pair_bytes, begun=begun)

            def receive() -> None:
                held()
                if fused:
                    kernels.ll_unpack(q, scales, rows, k, slot)
                else:
                    tokens = torch.arange(t * k + extra, device=x.device) % max(t * k, 1) // k
                    # (as bytes: CUDA has no fp8 index_copy)
                    slot["x"].view(torch.uint8).index_copy_(0, rows, _bytes(q).index_select(0, tokens))
                    if scales is not None:
                        slot["scales"].index_copy_(0, rows, scales.index_select(0, tokens))
                    slot["src_info"].index_copy_(0, rows, tokens.to(torch.int32))
                if cumulative_local_expert_recv_stats is not None:
                    cumulative_local_expert_recv_stats.add_(slot["count"])

            if not return_recv_hook:
                receive()
            event = streams.finish(stream, async_finish, (x, topk_idx))
        recv_x = slot["x"][:-1].view(n_local, cap, hidden)
        if use_fp8:
            recv_x = (recv_x, slot["scales"][:-1].view(n_local, cap, hidden // FP8_BLOCK))
        src_info = slot["src_info"][:-1].view(n_local, cap)
        handle = (src_info, slot["layout_range"], max_tokens, hidden, num_experts)
        hook = receive if return_recv_hook else None
        return recv_x, slot["count"], handle, event, hook

    def _rows_from_handle(self, handle: tuple, topk_idx: torch.Tensor, extra: int) -> torch.Tensor:
        """Each pair's slab row ``[T * k + extra]`` int64 (0 for no expert), read off a dispatch
        handle's ``src_info`` (each row's token) and its counts (``layout_range`` ``[L, N]``, or a
        group combine's ``[L]`` counts): a row of local expert ``le`` whose token is ``t`` holds
        that expert's output for ``t``. Where ``t`` has two rows in one expert (pairs "from" two
        ranks, or a hot rank's extra pairs), they hold the same output, so any one serves."""
        src_info, ranges, max_tokens, _, num_experts = handle
        n_local = num_experts // self.group_size
        cap = self.group_size * max_tokens
        dev = topk_idx.device
        counts = ranges.to(torch.int64) if ranges.dim() == 1 else (ranges & 0xFFFFFFFF).sum(1)
        live = torch.arange(cap, device=dev)[None, :] < counts[:, None]  # [L, cap]
        key = torch.arange(n_local, device=dev)[:, None] * max_tokens + src_info.reshape(n_local, cap).long()
        spare = n_local * max_tokens
        row_of = torch.zeros(spare + 1, dtype=torch.int64, device=dev)
        row_of.scatter_(0, torch.where(live, key, spare).reshape(-1), torch.arange(n_local * cap, device=dev))
        ids = self._with_extra(topk_idx, extra).reshape(-1)
        pairs = max(topk_idx.numel(), 1)
        tokens = torch.arange(ids.numel(), device=dev) % pairs // topk_idx.shape[1]
        valid = ids >= 0
        local = torch.where(valid, torch.remainder(ids, n_local), 0)
        return torch.where(valid, row_of[local * max_tokens + tokens], 0)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, *, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None) -> tuple:
        """DeepEP's low-latency combine of the experts' output ``x`` ``[L, N * M, hidden]`` bf16
        back to this rank's ``[T, hidden]`` tokens, weighted by ``topk_weights`` ``[T, k]``
        float32 (a pair whose id is ``-1`` is not summed). Returns ``(combined, event, hook)``."""
        self._check_alive()
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other")
        del use_logfmt, zero_copy
        _, _, max_tokens, hidden, num_experts = handle
        n, n_local = self.group_size, num_experts // self.group_size
        cap = n * max_tokens
        t, k = topk_idx.shape
        if tuple(x.shape) != (n_local, cap, hidden):
            raise ValueError(f"x must be [{n_local}, {cap}, {hidden}], got {list(x.shape)}")
        combined = out if out is not None else torch.empty((t, hidden), dtype=torch.bfloat16, device=x.device)
        streams = self._streams
        with streams.kernel(None, on_current=return_recv_hook) as stream:
            # the send: each pair's expert output row, packed per (token, expert)
            slot = self._slot_of(handle[0])
            extra = self.extra_pairs(t * k)
            if slot is not None and slot.get("pair_rows") is not None \
                    and slot["pair_rows"].numel() == t * k + extra:
                rows0 = slot["pair_rows"]
            else:  # a handle whose tensors were copied out of the buffer (sbo+dbo)
                rows0 = self._rows_from_handle(handle, topk_idx, extra)
            # (a group's combine masks whole experts' ids: the others' rows do not move, and the
            # bytes are its own pairs'); the extra pairs go back to their ranks, not summed here.
            # The count first: its kernel stamps the call's start
            begun = self._stamp(kernels.usable(topk_idx))
            units = self.remote_units(topk_idx, n_local, extra=extra, begun=begun)
            wire = x.reshape(n_local * cap, hidden).index_select(0, rows0)
            held = self._hold("combine", units, hidden * 2, begun=begun)
            slots = torch.arange(t * k, device=x.device).view(t, k)
            weights = topk_weights.to(torch.float32)
            local = topk_idx >= 0

            def receive() -> None:
                held()
                gather_reduce(wire, slots, weights, local, out=combined)

            if not return_recv_hook:
                receive()
            event = streams.finish(stream, async_finish, (x, topk_idx, topk_weights, combined))
        return combined, event, (receive if return_recv_hook else None)

    # ---- normal mode --------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """``(num_tokens_per_rank [N], num_tokens_per_rdma_rank [hosts] or None,
        num_tokens_per_expert [E], is_token_in_rank [T, N] bool, event)``."""
        self._check_alive()
        del allocate_on_comm_stream
        n, n_local = self.group_size, num_experts // self.group_size
        streams = self._streams
        with streams.kernel(previous_event, on_current=False) as stream:
            if kernels.usable(topk_idx) and topk_idx.shape[0]:
                # two launches, as DeepEP's layout is one kernel; the dispatch that takes this
                # table finds its received rows and counts here
                lay = self._ht_layout = kernels.ht_layout(topk_idx, n=n, n_local=n_local,
                                                          num_hosts=self.num_hosts, rank=self.rank)
                event = streams.finish(stream, async_finish, (topk_idx,))
                return lay.per_rank, lay.per_host, lay.per_expert, lay.in_rank, event
            valid = topk_idx >= 0
            dest = torch.where(valid, torch.div(topk_idx, n_local, rounding_mode="floor"), n)
            in_rank = torch.zeros((topk_idx.shape[0], n + 1), dtype=torch.bool, device=topk_idx.device)
            in_rank.scatter_(1, dest, True)
            in_rank = in_rank[:, :n].contiguous()
            per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
            per_expert.index_add_(0, torch.where(valid, topk_idx, num_experts).reshape(-1),
                                  torch.ones(topk_idx.numel(), dtype=torch.int32, device=topk_idx.device))
            per_rank = in_rank.sum(0, dtype=torch.int32)
            per_host = None
            if self.num_hosts > 1:
                per_host = in_rank.view(-1, self.num_hosts, n // self.num_hosts).any(2)
                per_host = per_host.sum(0, dtype=torch.int32)
            event = streams.finish(stream, async_finish, (topk_idx,))
        return per_rank, per_host, per_expert[:-1], in_rank, event

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: Any = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP's normal-mode dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``. Waits on the host for the received
        counts (after the notify's fixed cost over the link), as DeepEP does."""
        self._check_alive()
        if handle is not None:
            raise ValueError("the emulated buffer does not model a cached-handle dispatch")
        del num_tokens_per_rank, num_tokens_per_rdma_rank, config
        del allocate_on_comm_stream, num_worst_tokens
        q, scales = x if isinstance(x, tuple) else (x, None)
        t, k = topk_idx.shape
        n = self.group_size
        streams = self._streams
        with streams.kernel(previous_event, on_current=False) as stream:
            in_rank = is_token_in_rank  # [T, N] bool: token t is "received from" rank s
            n_local = num_tokens_per_expert.numel() // n
            lay, self._ht_layout = self._ht_layout, None
            if lay is not None and lay.in_rank is in_rank:  # counted with the layout
                pos, counts = lay.pos, lay.counts
                units = lay.units if self.remote_fraction is None else \
                    self._quantized(lay.other.to(torch.float32) * self.remote_fraction)
            else:
                flat = in_rank.t().reshape(-1)  # (source rank, token) order
                pos = torch.cumsum(flat.to(torch.int64), 0) - 1
                num_recv = flat.sum().reshape(1)
                valid = topk_idx >= 0
                local_ids = torch.where(valid, torch.remainder(topk_idx, n_local), n_local)
                per_expert = torch.zeros(n_local + 1, dtype=torch.int64, device=q.device)
                per_expert.index_add_(0, local_ids.reshape(-1),
                                      torch.ones(t * k, dtype=torch.int64, device=q.device))
                counts = torch.cat([num_recv, per_expert[:-1]])
                units = self._quantized(self.rows_off_host(in_rank))
            # the notify: the counts cross the link (its fixed cost), then the host reads them
            notify = self._hold("notify", self._no_bytes, 0.0,
                                fixed_us=None if self.link is None else self.link.fixed_us("dispatch"))
            notify()
            host = torch.empty(counts.shape, dtype=torch.int64, pin_memory=q.is_cuda)
            host.copy_(counts, non_blocking=q.is_cuda)
            if q.is_cuda:
                streams.host_wait(stream)  # DeepEP's host wait for the received counts
            got = host.tolist()
            m_recv, per_expert_list = got[0], got[1:]
            if expert_alignment > 1:
                per_expert_list = [-(-c // expert_alignment) * expert_alignment for c in per_expert_list]
            # the send: the rows pack into the send buffer; the bytes that leave the host
            send_q = q.clone()
            send_scales = None if scales is None else scales.clone()
            row_bytes = q.shape[1] * q.element_size() + (0 if scales is None else scales.shape[1] * 4)
            held = self._hold("dispatch", units, row_bytes, fixed_us=0.0)
            held()
            # the receive: each (source rank, token) row at its received row, with its local
            # top-k (-1 for experts of other ranks)
            if kernels.usable(q):
                recv_q, recv_scales, recv_ids, recv_weights, row_src = kernels.ht_receive(
                    send_q, send_scales, topk_idx, topk_weights, in_rank, pos, m_recv, n_local)
            else:
                spare = torch.where(in_rank.t().reshape(-1), pos, t * n)  # (source rank, token) order
                row_src = torch.zeros(t * n + 1, dtype=torch.int64, device=q.device)
                row_src.index_copy_(0, spare, torch.arange(t, device=q.device).repeat(n))
                row_src = row_src[:m_recv]
                row_rank = torch.zeros(t * n + 1, dtype=torch.int64, device=q.device)
                row_rank.index_copy_(0, spare, torch.arange(n, device=q.device).repeat_interleave(t))
                row_rank = row_rank[:m_recv]
                recv_q = send_q.index_select(0, row_src)
                recv_scales = None if send_scales is None else send_scales.index_select(0, row_src)
                ids = topk_idx.index_select(0, row_src)
                mine = (torch.div(ids, n_local, rounding_mode="floor") == row_rank[:, None]) & (ids >= 0)
                recv_ids = torch.where(mine, torch.remainder(ids, n_local), -1)
                recv_weights = torch.where(mine, topk_weights.index_select(0, row_src).to(torch.float32), 0.0)
            recv_x = recv_q if recv_scales is None else (recv_q, recv_scales)
            handle = _HTHandle(row_src, in_rank, t, pos, units)
            event = streams.finish(stream, async_finish, (q, topk_idx))
        return recv_x, recv_ids, recv_weights, per_expert_list, handle, event

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None,
                bias: Any = None, config: Any = None, previous_event: Any = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP's normal-mode combine of the received rows ``x`` ``[M_recv, hidden]`` bf16 (each
        already weighted and reduced over the rank's experts) into this rank's tokens:
        ``(combined [T, hidden] bf16, None, event)``."""
        self._check_alive()
        if not isinstance(handle, _HTHandle):
            raise TypeError("combine needs the handle of this buffer's dispatch")
        del topk_weights, bias, config, allocate_on_comm_stream
        streams = self._streams
        with streams.kernel(previous_event, on_current=False) as stream:
            send = x.clone()  # the rows pack into the send buffer
            # the rows go back the way they came: the dispatch's rows off the host
            held = self._hold("combine", handle.units, x.shape[1] * x.element_size())
            held()
            if kernels.usable(send):
                combined = kernels.ht_combine(send, handle.in_rank, handle.pos)
            else:
                acc = torch.zeros((handle.num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
                acc.index_add_(0, handle.row_src, send.float())
                combined = acc.to(torch.bfloat16)
            event = streams.finish(stream, async_finish, (x,))
        return combined, None, event

    def rows_off_host(self, in_rank: torch.Tensor) -> torch.Tensor:
        """The rows a normal-mode call sends over the link, ``[1]`` float32: one per (token,
        destination host other than this one) (DeepEP's RDMA path forwards inside a host over
        NVLink), or ``remote_fraction`` of the (token, other rank) rows where it is given."""
        if self.remote_fraction is not None:
            return (in_rank & self._other_rank).sum().to(torch.float32).reshape(1) * self.remote_fraction
        t, n = in_rank.shape
        per_host = in_rank.view(t, self.num_hosts, n // self.num_hosts).any(2)
        off = torch.arange(self.num_hosts, device=in_rank.device) != self._host
        return (per_host & off).sum().to(torch.float32).reshape(1)


@dataclass
class _HTHandle:
    """What a normal-mode combine needs of its dispatch: each received row's token, the
    (token, rank) table, the number of tokens, each (rank, token)'s received row (``[N * T]``,
    valid where the table says) and the rows that crossed the link (``[1]`` int64, 1/1024 units:
    the combine sends the same rows back)."""

    row_src: torch.Tensor
    in_rank: torch.Tensor
    num_tokens: int
    pos: torch.Tensor
    units: torch.Tensor
