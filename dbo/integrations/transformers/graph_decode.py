"""Greedy decode steps replayed from a CUDA graph: the host off the decode path.

An eager decode step of a transformers model is host-bound: every layer's Python (the model's,
FSDP's hooks, the MoE backend's) runs for a few tokens' worth of GPU work. Here the steps after
the first run from a static KV cache and static inputs, so that one CUDA graph holds a whole step
(every layer, the dispatches and combines of a capturable backend: ``deepep_ll``,
``copy_engine``) and each step is one replay:

- the joined prefill cache (a ``DynamicCache``) is copied into a transformers ``StaticCache`` of
  ``prompt + max_new_tokens`` slots (its public ``update``), whose layers write each step's keys
  and values in place at a device-side position; with ``split_decode`` each ubatch's cache into
  one of its own, and the captured step is the overlapped one (each ubatch's rows, through its
  cache);
- the step's inputs are static buffers: the token ``[batch, 1]``, its position ``[batch, 1]``
  and a 4-D boolean attention mask ``[batch, 1, 1, slots]`` (the prompt's padding, then one slot
  more each step), which transformers takes as it is;
- the first decode step runs eagerly (it warms up kernels and allocations), then one step is
  captured; the graph also writes the step's argmax into the token buffer and advances the
  position, so that between replays the host only marks the next slot in the mask and keeps the
  token.

Every rank captures at the same step (the MoE layers are collective inside the graph too). On
the CPU the same static-cache steps run eagerly, which is what the CPU tests check against the
plain decode (no host sync inside a step, the same tokens).

A replay runs no Python, so none of the backends' host-side checks for a dead or stalled peer
runs during one. :class:`ReplayPacer` stands in for them: the host queues at most
:data:`REPLAY_LEAD` replays ahead of the GPU (waiting for the oldest, the GIL released), and the
GPU watchdog (:data:`dbo.peers.watchdog.WATCHDOG`) ends the process, with a message naming the
step, where a replay has not finished :data:`REPLAY_WATCH_GRACE_S` after the timeout in force (a
:func:`~dbo.peers.watchdog.collective_timeout` block's, else :data:`REPLAY_DEFAULT_TIMEOUT_S`). A
copy-engine wait traps at the timeout itself, before that, and is raised named.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from dbo.peers.groups import group_rank
from dbo.peers.watchdog import WATCHDOG, GpuWaitWatchdog, WaitSite, resolve_timeout

__all__ = ["static_cache_from", "static_decode", "ReplayPacer", "REPLAY_LEAD", "REPLAY_WATCH_GRACE_S",
           "REPLAY_DEFAULT_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: replays the host queues ahead of the GPU at most (a replay is one whole decode step: two keep
#: the GPU fed, and the watch's deadline starts about when the GPU reaches the step)
REPLAY_LEAD = 2
#: a replay is watched for the timeout in force plus this: a copy-engine wait, which traps at the
#: timeout itself, fails first and is raised named
REPLAY_WATCH_GRACE_S = 1.0
#: the timeout of a replayed step outside any collective_timeout() block (the backends' default)
REPLAY_DEFAULT_TIMEOUT_S = 60.0


class _Pending:
    """A replay's event as the watchdog sees it: ``query()`` only, so that it is not pooled."""

    __slots__ = ("event",)

    def __init__(self, event: Any):
        self.event = event

    def query(self) -> bool:
        return self.event.query()


class ReplayPacer:
    """Paces and watches the replays of one decode graph (see the module docstring).

    Call :meth:`replayed` after each replay of step ``step`` (1-based, of ``steps``) and
    :meth:`drain` after the last. ``event`` makes an event with ``record()``, ``query()`` and
    ``synchronize()`` (``torch.cuda.Event``); ``watchdog`` the watchdog (the process's)."""

    def __init__(self, steps: int, rank: int, *, event: Callable[[], Any] | None = None,
                 watchdog: GpuWaitWatchdog | None = None, lead: int = REPLAY_LEAD):
        if lead < 1:
            raise ValueError(f"lead must be >= 1, got {lead}")
        self.steps, self.rank, self.lead = steps, rank, lead
        self.timeout_s = resolve_timeout(REPLAY_DEFAULT_TIMEOUT_S) + REPLAY_WATCH_GRACE_S
        self._event = event or torch.cuda.Event
        self._watchdog = WATCHDOG if watchdog is None else watchdog
        self._queued: collections.deque[Any] = collections.deque()

    def replayed(self, step: int) -> None:
        event = self._event()
        event.record()
        site = WaitSite("greedy_generate", f"replayed decode step {step} of {self.steps} (a CUDA graph: "
                        "no host-side peer check runs in it)", 0, self.rank)
        self._watchdog.watch(_Pending(event), self.timeout_s, site)
        self._queued.append(event)
        while len(self._queued) > self.lead:
            self._queued.popleft().synchronize()

    def drain(self) -> None:
        while self._queued:
            self._queued.popleft().synchronize()


def static_cache_from(model: torch.nn.Module, cache: Any, slots: int) -> Any | None:
    """A transformers ``StaticCache`` of ``slots`` positions holding ``cache``'s keys and values
    (a ``DynamicCache`` of full-attention layers), or None where it cannot hold them (another
    cache or layer type, or transformers without ``StaticCache``)."""
    try:
        from transformers.cache_utils import DynamicCache, StaticCache
    except ImportError:  # pragma: no cover - a transformers without them
        return None
    layers = getattr(cache, "layers", None)
    if type(cache) is not DynamicCache or not layers:
        return None
    if any(type(layer).__name__ != "DynamicLayer"
           or not isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return None
    try:
        static = StaticCache(config=model.config, max_cache_len=slots)
    except (TypeError, ValueError) as exc:
        logger.info("greedy_generate: no StaticCache for this model (%s)", exc)
        return None
    if len(static.layers) != len(layers) or any(type(x).__name__ != "StaticLayer" for x in static.layers):
        return None
    if layers[0].keys.shape[-2] >= slots:
        raise ValueError(f"the prefill's {layers[0].keys.shape[-2]} positions leave no slot of {slots}")
    for index, layer in enumerate(layers):
        static.update(layer.keys, layer.values, index)
    return static


def static_decode(step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                  ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: int,
                  steps: int, capture: bool) -> torch.Tensor:
    """Run ``steps`` greedy decode steps from a static cache: ``step(ids, mask4d, positions)``
    runs the model on it and returns the last position's logits ``[batch, vocab]``.

    Args:
        ids: ``[batch, 1]`` the first step's token.
        positions: ``[batch, 1]`` its position.
        mask: ``[batch, filled + 1]`` the attention mask so far (the prompt's, then ones), whose
            last column is the first step's own slot.
        slots: the static cache's length.
        steps: decode steps (>= 1).
        capture: replay the steps after the first from one CUDA graph (CUDA tensors); else run
            every step eagerly.

    Returns:
        ``[batch, steps]`` the new tokens.
    """
    batch, first = ids.shape[0], mask.shape[1] - 1  # the first step's slot
    if first + steps > slots:
        raise ValueError(f"{steps} steps from slot {first} need {first + steps} slots, the cache has {slots}")
    mask4d = torch.zeros(batch, 1, 1, slots, dtype=torch.bool, device=ids.device)
    mask4d[:, 0, 0, :first + 1] = mask.bool()
    ids_buf, pos_buf = ids.clone(), positions.clone()
    tokens: list[torch.Tensor] = []

    def advance(nxt: torch.Tensor) -> None:
        ids_buf.copy_(nxt)
        pos_buf.add_(1)

    def open_next_slot(i: int) -> None:  # after step i: the next step's own slot
        if i + 1 < steps:
            mask4d[:, 0, 0, first + i + 1] = True

    def eager(i: int) -> None:
        nxt = step(ids_buf, mask4d, pos_buf).argmax(-1, keepdim=True)
        tokens.append(nxt)
        advance(nxt)
        open_next_slot(i)

    if not capture:
        for i in range(steps):
            eager(i)
        return torch.cat(tokens, dim=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first step, eager: kernels, allocations, lazy state
        eager(0)
    torch.cuda.current_stream().wait_stream(side)
    if steps == 1:
        return torch.cat(tokens, dim=1)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            advance(step(ids_buf, mask4d, pos_buf).argmax(-1, keepdim=True))
    except Exception as exc:
        raise RuntimeError(f"greedy_generate(cuda_graph=True): capturing a decode step failed "
                           f"({type(exc).__name__}: {exc}); decode eagerly (cuda_graph=False). "
                           "A failed capture may leave a backend's buffers out of step: "
                           "restart the process") from exc
    pacer = ReplayPacer(steps, group_rank())
    for i in range(1, steps):
        graph.replay()
        tokens.append(ids_buf.clone())
        open_next_slot(i)
        pacer.replayed(i + 1)
    pacer.drain()
    return torch.cat(tokens, dim=1)
