"""What the torch.distributed backends (``naive``, ``all2all``) share.

* :class:`TorchDistPrepareAndFinalize`: process group, expert placement, argument checks, the
  blocking metadata exchange that also checks that every rank passed compatible arguments, and
  the stream protocol (NCCL: collectives on the comm stream; gloo: ``async_op`` work whose
  completion the recv hook waits for).
* :class:`PendingWork`: async work waited on with a bounded timeout; a peer that fails or stops
  turns into :class:`dbo.errors.CollectiveTimeoutError` instead of a hang. Each collective is
  started through :meth:`TorchDistPrepareAndFinalize._start` (a :class:`dbo.peers.work.LentWork`),
  so on gloo its wait returns only once gloo's worker thread has freed the work: a program may
  end right after its last MoE layer without gloo's thread aborting it at exit.
* Row packing: tokens, routing ids and weights travel as one ``uint8`` tensor, so a dispatch
  is one collective, not three.

Collective order: every rank must issue collectives in the same order. Within a step each
backend call issues a fixed sequence (metadata, then data), and the ubatch schedule is the same
on every rank, so the order is the same everywhere even when two ubatches interleave.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils.weak import WeakIdKeyDictionary

from dbo.errors import CollectiveTimeoutError
from dbo.moe.base import (
    ActivationFormat,
    PrepareAndFinalize,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)
from dbo.moe.validate import (
    IdsRangeCheck,
    check_routing_inputs,
    contiguous_expert_map,
    num_local_experts_for,
)
from dbo.peers.watchdog import resolve_timeout
from dbo.peers.work import LentWork
from dbo.ubatch.context import (
    dbo_current_ubatch_id,
)

__all__ = [
    "TorchDistPrepareAndFinalize",
    "PendingWork",
    "pack_rows",
    "unpack_rows",
    "all_gather_single",
    "reduce_scatter_single",
    "DTYPE_CODES",
    "MetaRow",
    "META_HEADER_LEN",
    "check_factory_dtype",
    "factory_for",
]

logger = logging.getLogger(__name__)

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class MetaRow(NamedTuple):
    """One rank's row of the metadata exchange of a step (all ints): the header every
    torch.distributed backend sends, then the backend's own columns, ``extra`` (all2all's
    rows for each destination rank, in rank order)."""

    num_tokens: int
    hidden: int
    topk: int
    dtype: int  #: ``DTYPE_CODES[a1.dtype]``, -1 for another dtype
    num_experts: int
    apply_router_weight_on_input: int
    extra: tuple[int, ...] = ()

    def as_list(self) -> list[int]:
        """The row as it travels: the header, then ``extra``."""
        return [*self[:META_HEADER_LEN], *self.extra]

    @classmethod
    def parse(cls, row: Sequence[int]) -> MetaRow:
        """The inverse of :meth:`as_list`."""
        return cls(*row[:META_HEADER_LEN], extra=tuple(row[META_HEADER_LEN:]))


#: entries of a :class:`MetaRow`'s header, the columns before ``extra``
META_HEADER_LEN = len(MetaRow._fields) - 1

_META_NAMES = {
    "hidden": "a1 (hidden_states) hidden size",
    "topk": "topk (topk_ids.shape[1])",
    "dtype": "a1 (hidden_states) dtype code (bf16=0, fp16=1, fp32=2)",
    "num_experts": "num_experts",
    "apply_router_weight_on_input": "apply_router_weight_on_input",
}


# torch 2.13 renamed these (the old names warn); older torch has only the old names. Taken from
# the module that defines them, not from torch.distributed's namespace, so that a counter put
# into the namespace (dbo.integrations.transformers.fsdp.count_all_gathered_bytes) neither
# counts dbo's own collectives nor stays bound here, whichever is imported first.
_all_gather_single = getattr(distributed_c10d, "all_gather_single", None) \
    or distributed_c10d.all_gather_into_tensor
_reduce_scatter_single = getattr(distributed_c10d, "reduce_scatter_single", None) \
    or distributed_c10d.reduce_scatter_tensor


def all_gather_single(output: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """``output`` ``[world * N, ...]`` <- every rank's ``inp`` ``[N, ...]``, in rank order."""
    return _all_gather_single(output, inp, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, inp: torch.Tensor, group: Any,
                          async_op: bool) -> Any:
    """``output`` ``[N, ...]`` <- sum over ranks of rows ``[rank * N, (rank + 1) * N)`` of
    ``inp``."""
    return _reduce_scatter_single(output, inp, op=dist.ReduceOp.SUM, group=group,
                                  async_op=async_op)


def check_factory_dtype(name: str, dtype: torch.dtype) -> None:
    """``TypeError`` unless backend ``name`` can move activations of ``dtype``
    (:data:`DTYPE_CODES`: bfloat16, float16, float32)."""
    if dtype not in DTYPE_CODES:
        raise TypeError(f"backend {name!r} moves bfloat16, float16 or float32 activations, "
                        f"got dtype={dtype}")


def factory_for(cls: type, name: str):
    """The registry's ``make_prepare_finalize`` for a :class:`TorchDistPrepareAndFinalize`
    subclass ``cls`` registered as ``name``: builds ``cls`` on ``group`` for calls with
    ``hidden`` columns in ``dtype`` (bfloat16, float16 or float32); the options are the
    constructor's. ``max_tokens_per_rank``, ``num_experts``, ``topk`` and ``device`` are the
    registry's uniform signature: nothing is sized ahead, and each call checks that the ranks
    agree on its shapes."""

    def make_prepare_finalize(group: Any = None, *, hidden: int, max_tokens_per_rank: int | None = None,
                              num_experts: int, topk: int, dtype: torch.dtype = torch.float32,
                              device: torch.device | str | None = None, timeout_s: float = 60.0,
                              check_inputs: bool = True, use_async: bool = True,
                              check_ids_every_call: bool = False) -> TorchDistPrepareAndFinalize:
        del max_tokens_per_rank, num_experts, topk, device
        check_factory_dtype(name, dtype)
        return cls(group, hidden_size=hidden, timeout_s=timeout_s, check_inputs=check_inputs,
                   use_async=use_async, check_ids_every_call=check_ids_every_call)

    make_prepare_finalize.__doc__ = f"Build a :class:`{cls.__name__}`: see :func:`factory_for`."
    return make_prepare_finalize


def pack_rows(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate row-aligned tensors ``[N, ...]`` byte-wise into one ``[N, bytes]`` uint8."""
    flat = []
    for p in parts:
        cols = 1
        for s in p.shape[1:]:
            cols *= s
        flat.append(p.contiguous().view(p.shape[0], cols).view(torch.uint8))
    return torch.cat(flat, dim=1)


def unpack_rows(packed: torch.Tensor, specs: Sequence[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: ``specs`` lists ``(columns, dtype)`` of each part."""
    out, col = [], 0
    for cols, dtype in specs:
        nbytes = cols * dtype.itemsize
        out.append(packed[:, col:col + nbytes].contiguous().view(dtype))
        col += nbytes
    return out


class PendingWork:
    """Async collective work of one ubatch, waited for once with a bounded timeout.

    ``works``: what :meth:`TorchDistPrepareAndFinalize._start` returned (``None`` entries are
    skipped). ``what`` names the collective in errors. Under NCCL ``wait`` only makes the current
    stream wait (it does not block the CPU); the process group's timeout and NCCL watchdog bound
    it. Under gloo it returns once the data has arrived and gloo has freed the work.
    """

    def __init__(self, works: Sequence[LentWork | None], what: str, timeout_s: float, nccl: bool):
        self.works = [w for w in works if w is not None]
        self.what = what
        self.timeout_s = timeout_s
        self.nccl = nccl
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self.nccl:
            for w in self.works:
                w.wait()
            return
        timeout = resolve_timeout(self.timeout_s)  # a collective_timeout() block overrides it
        deadline = time.monotonic() + timeout
        for w in self.works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                w.wait(left)
            except Exception as exc:  # noqa: BLE001 - gloo raises plain RuntimeError/DistError
                raise CollectiveTimeoutError(
                    f"{self.what} failed or did not complete within {timeout:.1f} s: a peer rank "
                    f"failed or stopped ({type(exc).__name__}: {exc})"
                ) from exc


class TorchDistPrepareAndFinalize(PrepareAndFinalize):
    """Base of the torch.distributed backends (STANDARD format, contiguous expert placement).

    Args:
        group: the expert-parallel process group (default: the world).
        hidden_size: if given, every call must have this hidden size.
        timeout_s: bound on each wait for a collective (gloo); a peer that fails or stops makes
            the wait raise :class:`CollectiveTimeoutError`. Under NCCL the process group's own
            timeout applies.
        check_inputs: check argument types, shapes and ``topk_ids`` range (the range check
            reads the ids: on GPU a device sync, so it runs at the first call only).
        check_ids_every_call: read device ``topk_ids`` at every call, not only the first (a
            device sync per dispatch: for debugging).
        use_async: implement ``prepare_async``/``finalize_async`` (else only the sync path).
    """

    name = "torchdist"

    def __init__(self, group: Any = None, *, hidden_size: int | None = None,
                 timeout_s: float = 60.0, check_inputs: bool = True, use_async: bool = True,
                 check_ids_every_call: bool = False):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialized torch.distributed "
                               "process group")
        if hidden_size is not None and hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.hidden_size = hidden_size
        self.timeout_s = float(timeout_s)
        self.check_inputs = check_inputs
        self._ids_check = IdsRangeCheck(check_ids_every_call)
        self.use_async = use_async
        # expert maps that passed the check -> (their _version then, num_experts): held weakly and
        # compared by identity, so a map's entry dies with it (a new tensor that gets a freed
        # map's id() is checked afresh)
        self._checked_maps: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # ---- PrepareAndFinalize properties --------------------------------------------------

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    def num_dispatchers(self) -> int:
        return self.world_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return self.use_async

    # ---- argument handling --------------------------------------------------------------

    def _what(self, step: str) -> str:
        return f"{self.name} {step} (rank {self.rank}, ubatch {dbo_current_ubatch_id()})"

    def _check(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               num_experts: int, router_on_input: bool) -> int:
        """Check the arguments; return the number of local experts."""
        if self.check_inputs:
            check_routing_inputs(a1, topk_weights, topk_ids, num_experts,
                                 hidden_size=self.hidden_size,
                                 check_ids_range=self._ids_check(topk_ids),
                                 apply_router_weight_on_input=router_on_input)
        return num_local_experts_for(num_experts, self.world_size)

    @staticmethod
    def _weighted_output(output: torch.Tensor, num_tokens: int, hidden: int,
                         fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                         weight_and_reduce: TopKWeightAndReduce) -> torch.Tensor:
        """Check ``output`` is ``[num_tokens, hidden]`` (the prepared tokens) and weight and
        reduce the experts' output over the local top-k (``Contiguous`` where the experts
        delegate it): ``[R, hidden]`` in ``output``'s dtype, contiguous, one row per received
        row."""
        if output.shape != (num_tokens, hidden):
            raise ValueError(f"output must be [{num_tokens}, {hidden}] (the prepared tokens), "
                             f"got shape {tuple(output.shape)}")
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            weight_and_reduce = TopKWeightAndReduceContiguous()
        y = weight_and_reduce.apply(None, fused_expert_output, topk_weights, topk_ids,
                                    apply_router_weight_on_input)
        return y.to(output.dtype).contiguous()

    def _check_expert_map(self, expert_map: torch.Tensor | None, num_experts: int) -> None:
        """``ValueError`` unless ``expert_map`` is None or the contiguous placement (rank ``r``
        holds ``[r * L, (r + 1) * L)``); a map already checked and not modified since is not
        read again (the check reads the device)."""
        if expert_map is None or \
                self._checked_maps.get(expert_map) == (expert_map._version, num_experts):
            return
        want = contiguous_expert_map(num_experts, self.world_size, self.rank, expert_map.device)
        if expert_map.shape != want.shape or not torch.equal(expert_map.to(torch.int32), want):
            raise ValueError(f"expert_map: the {self.name} backend supports only the contiguous "
                             f"expert placement (rank r holds experts [r*L, (r+1)*L)); got {expert_map}")
        self._checked_maps[expert_map] = (expert_map._version, num_experts)

    @staticmethod
    def _router_on_input(a1: torch.Tensor, topk_weights: torch.Tensor, on: bool) -> torch.Tensor:
        if not on:
            return a1
        return (a1.to(torch.float32) * topk_weights).to(a1.dtype)

    def _start(self, issue: Callable[..., Any], *tensors: torch.Tensor) -> LentWork:
        """Start a collective: ``issue(*views)`` with one view per tensor of ``tensors``
        returns its work (``async_op=True``); see :class:`dbo.peers.work.LentWork`. Under
        NCCL ``issue`` gets the tensors themselves."""
        return LentWork(issue, tensors, lend=not self.nccl)

    # ---- the blocking metadata exchange -------------------------------------------------

    def _exchange_meta(self, a1: torch.Tensor, topk: int, num_experts: int,
                       router_on_input: bool, extra: Sequence[int] = ()) -> list[MetaRow]:
        """All-gather every rank's :class:`MetaRow` (blocking, bounded) and check that the ranks
        agree on the header (the token counts aside).

        Every rank sees the same table, so a disagreement raises the same ``ValueError`` on
        every rank and none is left waiting in a later collective.
        """
        meta = MetaRow(a1.shape[0], a1.shape[1], topk, DTYPE_CODES.get(a1.dtype, -1), num_experts,
                       int(router_on_input), tuple(extra))
        if self.world_size == 1:
            # nothing to agree on, and over NCCL the exchange's read-back would make the host
            # wait for the GPU at every dispatch (a host-bound DBO step at one rank)
            return [meta]
        row = meta.as_list()
        device = a1.device if self.nccl else torch.device("cpu")
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        table = torch.empty(self.world_size * len(row), dtype=torch.int64, device=device)
        what = self._what("metadata exchange")
        work = self._start(lambda out, inp: all_gather_single(out, inp, self.group, async_op=True),
                           table, mine)
        PendingWork([work], what, self.timeout_s, self.nccl).wait()
        rows = [MetaRow.parse(r) for r in table.view(self.world_size, len(row)).tolist()]
        for key in _META_NAMES:
            vals = [getattr(r, key) for r in rows]
            if len(set(vals)) > 1:
                raise ValueError(f"{_META_NAMES[key]} differs across ranks: "
                                 + ", ".join(f"rank {i}={v}" for i, v in enumerate(vals)))
        return rows

    # ---- stream protocol: PrepareAndFinalize.comm_section (enabled=self.nccl) ------------

    def _async_result(self, pending: PendingWork, receiver: Any) -> Any:
        """``(hook, receiver)``: the hook waits for the data (gloo) or is only a yield point
        (NCCL, where the receiver makes the compute stream wait)."""
        if self.nccl:
            return (lambda: None), receiver
        return pending.wait, receiver
