"""DeepEP buffer management: find the installed DeepEP API, create or reuse a group's buffer.

DeepEP buffers are expensive (NVLink/NVSHMEM registration, a collective over the group), so
every backend of one group and mode shares one. :func:`get_deepep_buffer` returns a
:class:`SharedDeepEPBuffer` whose ``.buffer`` the cache may replace by a larger one when a
later request does not fit; backends read ``.buffer`` at each call, never keep the object.

Creating, growing and :meth:`DeepEPBufferCache.reset` are collective: every rank of the group
must make the same calls in the same order. This module and ``backends/deepep_*.py`` are the
only places that import ``deep_ep``.
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import torch

from dbo.errors import DBOError
from dbo.peers.arrival import ArrivalBoard

__all__ = [
    "INSTALL_HINT",
    "DeepEPNotInstalledError",
    "DeepEPAPIError",
    "DeepEPDtypeError",
    "BufferMode",
    "DeepEPApi",
    "BufferRequest",
    "SharedDeepEPBuffer",
    "DeepEPBufferCache",
    "BUFFER_CACHE",
    "import_deep_ep",
    "detect_deep_ep_api",
    "get_deepep_buffer",
    "round_up_hidden",
    "LOW_LATENCY_HIDDEN_SIZES",
    "TRANSFER_ATOM_BYTES",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "Install it with the project's extra, `pip install -e \".[deepep]\"` (the prebuilt wheel "
    "tokenspeed-deepep==1.2.1.post20251110: DeepEP's Buffer API, built for CUDA 13), or build "
    "DeepEP from source (https://github.com/deepseek-ai/DeepEP; DeepEP >= 2.0 for the v2 backend). "
    "On a host without access to the package index: run `bash tools/offline_wheels.sh` where pip "
    "can reach it, copy `.whl/` with the project, then `pip install --no-index --find-links .whl "
    "-e \".[deepep]\"` (docs/backends.md, \"Installing DeepEP\")."
)

#: DeepEP moves rows in 512-byte atoms (32 lanes x 16 bytes); hidden sizes are padded to it.
TRANSFER_ATOM_BYTES = 512

#: Hidden sizes the low-latency kernels are compiled for (DeepEP v1.2.1, ``SWITCH_HIDDEN``).
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)


class DeepEPNotInstalledError(DBOError, ImportError):
    """``deep_ep`` cannot be imported; the message names the install step."""


class DeepEPAPIError(DBOError, RuntimeError):
    """The installed ``deep_ep`` lacks the API (``Buffer`` or ``ElasticBuffer``/``EPBuffer``)
    that a backend needs, or a DeepEP limit would be exceeded."""


class DeepEPDtypeError(DBOError, TypeError):
    """A tensor has a dtype the DeepEP kernel does not accept (e.g. combine is bf16 only)."""


class BufferMode(enum.Enum):
    """Which DeepEP buffer: v1 ``Buffer`` normal mode, v1 low-latency mode, or v2."""

    HIGH_THROUGHPUT = "ht"
    LOW_LATENCY = "ll"
    V2 = "v2"


@dataclass(frozen=True)
class DeepEPApi:
    """What the installed ``deep_ep`` offers.

    ``buffer_cls``: the v1 ``Buffer`` (normal and low-latency modes), or None.
    ``v2_cls``: ``EPBuffer`` (newer) or ``ElasticBuffer`` (DeepEP 2.0/2.1), or None.
    """

    module: ModuleType
    version: str | None
    buffer_cls: type | None
    v2_cls: type | None

    @property
    def v2_name(self) -> str | None:
        return None if self.v2_cls is None else self.v2_cls.__name__

    def describe(self) -> str:
        parts = [f"deep_ep {self.version or '(no __version__)'}"]
        parts.append("Buffer" if self.buffer_cls is not None else "no Buffer")
        parts.append(self.v2_name or "no ElasticBuffer/EPBuffer")
        return ", ".join(parts)


def import_deep_ep() -> ModuleType:
    """Import ``deep_ep`` or raise :class:`DeepEPNotInstalledError` naming the install step."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise DeepEPNotInstalledError(f"deep_ep is not importable ({exc}). {INSTALL_HINT}") from exc


def detect_deep_ep_api(module: ModuleType | None = None) -> DeepEPApi:
    """Which DeepEP API is installed (imports ``deep_ep`` unless ``module`` is given)."""
    mod = import_deep_ep() if module is None else module
    v2 = getattr(mod, "EPBuffer", None) or getattr(mod, "ElasticBuffer", None)
    return DeepEPApi(mod, getattr(mod, "__version__", None), getattr(mod, "Buffer", None), v2)


def round_up_hidden(hidden: int, dtype: torch.dtype, atom_bytes: int = TRANSFER_ATOM_BYTES) -> int:
    """The smallest hidden size >= ``hidden`` whose rows of ``dtype`` are whole transfer atoms."""
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    size = torch.empty((), dtype=dtype).element_size()
    row = hidden * size
    padded = -(-row // atom_bytes) * atom_bytes
    if padded % size:
        raise ValueError(f"{atom_bytes}-byte atoms do not hold whole {dtype} elements")
    return padded // size


@dataclass(frozen=True)
class BufferRequest:
    """What a backend needs from its buffer. All ranks of the group must pass equal requests.

    ``hidden``: the hidden size as transferred (already padded). ``max_tokens_per_rank``: the
    most tokens one rank dispatches in one call (low-latency and v2 size their buffers by it).
    """

    mode: BufferMode
    hidden: int
    max_tokens_per_rank: int
    num_experts: int
    topk: int
    use_fp8_dispatch: bool = False

    def covers(self, other: BufferRequest) -> bool:
        """True if a buffer made for ``self`` also serves ``other``."""
        if self.mode is not other.mode:
            return False
        if self.mode is BufferMode.LOW_LATENCY and self.num_experts != other.num_experts:
            return False  # the QP count is tied to the number of local experts
        return (self.hidden >= other.hidden and self.max_tokens_per_rank >= other.max_tokens_per_rank
                and self.num_experts >= other.num_experts and self.topk >= other.topk
                and (self.use_fp8_dispatch or not other.use_fp8_dispatch))

    def union(self, other: BufferRequest) -> BufferRequest:
        return replace(self, hidden=max(self.hidden, other.hidden),
                       max_tokens_per_rank=max(self.max_tokens_per_rank, other.max_tokens_per_rank),
                       num_experts=max(self.num_experts, other.num_experts),
                       topk=max(self.topk, other.topk),
                       use_fp8_dispatch=self.use_fp8_dispatch or other.use_fp8_dispatch)


@dataclass
class SharedDeepEPBuffer:
    """The buffer of one (group, mode), shared by every backend of it.

    ``buffer`` is a ``deep_ep.Buffer`` (modes ht/ll) or an ``ElasticBuffer``/``EPBuffer`` (v2);
    it may be replaced when the cache grows it, so read it at each call. ``low_latency_layout``
    is the ``(max_tokens_per_rank, hidden, num_experts)`` the low-latency kernels last ran
    with (the buffer must be cleaned when it changes).
    """

    group: Any
    api: DeepEPApi
    request: BufferRequest
    buffer: Any
    generation: int = 0
    low_latency_layout: tuple[int, int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: each rank's launch count, shared by the backends of this buffer (None: no check)
    arrival: ArrivalBoard | None = None

    def prepare_low_latency(self, max_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Clean the low-latency buffer if the kernels last ran with another layout."""
        layout = (max_tokens_per_rank, hidden, num_experts)
        if self.low_latency_layout is not None and self.low_latency_layout != layout:
            self.buffer.clean_low_latency_buffer(max_tokens_per_rank, hidden, num_experts)
        self.low_latency_layout = layout


def _group_size(group: Any) -> int:
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def _arrival_board(group: Any) -> ArrivalBoard:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and isinstance(group, dist.ProcessGroup):
        return ArrivalBoard.create(group)
    # a stand-in group (unit tests): no peer is visible
    return ArrivalBoard.local(group.rank() if hasattr(group, "rank") else 0, _group_size(group))


def _create(api: DeepEPApi, group: Any, req: BufferRequest) -> Any:
    num_ranks = _group_size(group)
    if req.mode is BufferMode.V2:
        if api.v2_cls is None:
            raise DeepEPAPIError(
                f"the deepep_v2 backend needs DeepEP's ElasticBuffer or EPBuffer (DeepEP >= 2.0); "
                f"installed: {api.describe()}. {INSTALL_HINT}")
        return api.v2_cls(group, num_max_tokens_per_rank=req.max_tokens_per_rank,
                          hidden=req.hidden, num_topk=req.topk,
                          use_fp8_dispatch=req.use_fp8_dispatch, explicitly_destroy=True)
    buffer_cls = api.buffer_cls
    if buffer_cls is None:
        raise DeepEPAPIError(f"the deepep_{req.mode.value} backend needs deep_ep.Buffer; installed: "
                             f"{api.describe()}. {INSTALL_HINT}")
    if req.mode is BufferMode.LOW_LATENCY:
        if req.num_experts % num_ranks:
            raise ValueError(f"num_experts ({req.num_experts}) must be a multiple of the group size "
                             f"({num_ranks}) in low-latency mode")
        num_rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
            req.max_tokens_per_rank, req.hidden, num_ranks, req.num_experts)
        return buffer_cls(group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes,
                          low_latency_mode=True, num_qps_per_rank=req.num_experts // num_ranks,
                          explicitly_destroy=True)
    # Normal mode: size for both recommended configs, in bf16 (the larger of bf16 and fp8).
    hidden_bytes = req.hidden * 2
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (buffer_cls.get_dispatch_config(num_ranks), buffer_cls.get_combine_config(num_ranks)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return buffer_cls(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                      low_latency_mode=False, explicitly_destroy=True)


class DeepEPBufferCache:
    """One :class:`SharedDeepEPBuffer` per (group, mode), grown on demand; ``reset()`` frees all."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, BufferMode], SharedDeepEPBuffer] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, group: Any, request: BufferRequest, api: DeepEPApi | None = None) -> SharedDeepEPBuffer:
        """The shared buffer of ``group`` for ``request.mode``, created or grown to fit."""
        with self._lock:
            key = (id(group), request.mode)
            entry = self._entries.get(key)
            if entry is not None and entry.request.covers(request):
                return entry
            api = api or (entry.api if entry is not None else detect_deep_ep_api())
            want = request if entry is None else entry.request.union(request)
            buffer = _create(api, group, want)
            if entry is None:
                entry = SharedDeepEPBuffer(group, api, want, buffer)
                # collective too: which peers reached each launch (see dbo.peers.arrival)
                entry.arrival = _arrival_board(group)
                self._entries[key] = entry
                logger.info("created DeepEP %s buffer for %s", request.mode.value, want)
            else:
                old = entry.buffer
                entry.buffer, entry.request = buffer, want
                entry.generation += 1
                entry.low_latency_layout = None
                _destroy(old)
                logger.info("grew DeepEP %s buffer to %s", request.mode.value, want)
            return entry

    def reset(self) -> None:
        """Destroy every buffer (collective: all ranks must call it) and forget them."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            _destroy(entry.buffer)
            if entry.arrival is not None:
                entry.arrival.close()


def _destroy(buffer: Any) -> None:
    if getattr(buffer, "explicitly_destroy", False) and getattr(buffer, "runtime", None) is not None:
        buffer.destroy()


#: The process-wide cache (one object with ``reset()``, per the house rules).
BUFFER_CACHE = DeepEPBufferCache()


def get_deepep_buffer(
    group: Any,
    *,
    mode: BufferMode | str,
    hidden: int,
    max_tokens_per_rank: int,
    num_experts: int,
    topk: int,
    use_fp8_dispatch: bool = False,
    cache: DeepEPBufferCache | None = None,
) -> SharedDeepEPBuffer:
    """Create or reuse the DeepEP buffer of ``group`` for ``mode`` (collective on first use).

    Args:
        group: the expert-parallel process group (NCCL on GPUs); None for the world group.
        mode: ``"ht"`` (v1 normal mode), ``"ll"`` (v1 low-latency) or ``"v2"``.
        hidden: hidden size as transferred, already padded by the backend.
        max_tokens_per_rank: most tokens one rank sends per call (ll and v2 size by it).
        num_experts: global number of experts.
        topk: experts per token.
        use_fp8_dispatch: size for fp8 dispatch too (v2).
        cache: the cache to use (default :data:`BUFFER_CACHE`).

    Raises:
        DeepEPNotInstalledError: ``deep_ep`` is missing (the message names the install step).
        DeepEPAPIError: the installed DeepEP lacks the API for ``mode``.
    """
    if group is None:  # DeepEP needs a group object; None means the default (world) group
        group = torch.distributed.group.WORLD
    req = BufferRequest(BufferMode(mode), int(hidden), int(max_tokens_per_rank), int(num_experts),
                        int(topk), bool(use_fp8_dispatch))
    if min(req.hidden, req.max_tokens_per_rank, req.num_experts, req.topk) <= 0:
        raise ValueError(f"hidden, max_tokens_per_rank, num_experts and topk must be positive: {req}")
    return (cache if cache is not None else BUFFER_CACHE).get(group, req)
