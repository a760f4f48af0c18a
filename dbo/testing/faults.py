"""Fault injection for the DeepEP backends: a peer that exits, stalls or is slow mid-step.

:func:`faulty_step` runs on every rank of a group (CPU with the fake ``deep_ep`` over gloo, or
CUDA with the real one): a fault-free reference step of ``layers`` MoE layers, then the same
step again, serially or as two ubatches, with rank ``fail_rank``'s backend made to misbehave
(:class:`Fault`) at the first dispatch (or combine) of the second layer:

* ``exit_before_dispatch`` / ``exit_before_combine``: the process exits (status
  :data:`FAULT_EXIT_CODE`) as the backend's ``prepare_async``/``finalize_async`` is called;
* ``exit_after_send``: the dispatch is launched, then the process exits (under DBO with the
  low-latency backend: in place of running its recv hook, i.e. between the send and the
  receive);
* ``stall``: the host sleeps ``timeout_s + 2`` s before the dispatch, then goes on;
* ``slow``: the host sleeps ``0.4 * timeout_s`` before the dispatch (no error may follow);
* ``gpu_stall``: the GPU (not the host) is kept busy ``timeout_s + 3`` s before the dispatch
  (CUDA only; ``torch.cuda._sleep``): the host arrives, the GPU does not;
* ``stall_before_combine`` / ``gpu_stall_before_combine``: the same stalls as
  ``finalize_async`` is called (between the dispatch and the combine);
* ``exit_after_combine`` / ``stall_after_combine`` / ``gpu_stall_after_combine``: the same
  once the combine is complete on this rank (its receiver returned).

:class:`Fault` wraps any object's dispatch and combine methods (``prepare_async`` /
``finalize_async`` by default; transformers' own ``AllToAllEP`` has ``_dispatch_tokens`` /
``_combine_tokens``): a combine that returns neither a receiver nor a ``(hook, receiver)`` pair
is complete when it returns.

An exiting rank first waits for its GPU (``synchronize``), as a process that dies a moment
after its last launch would. Before the fault it writes the wall-clock time to
``stamp_path``, so the survivor's (or the driver's) time to the error can be measured.

A fault leaves its group out of step, so the GPU fault runners start a fresh set of rank
processes per case (:mod:`dbo.testing.ranks`).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dbo.ubatch.context import run_ubatches

__all__ = ["FAULTS", "FAULT_EXIT_CODE", "Fault", "faulty_step", "error_chain",
           "make_deepep_backend", "per_launch_check_cost", "check_survivor"]

FAULTS = ("none", "slow", "stall", "exit_before_dispatch", "exit_after_send",
          "exit_before_combine", "gpu_stall", "stall_before_combine", "gpu_stall_before_combine",
          "exit_after_combine", "stall_after_combine", "gpu_stall_after_combine")
FAULT_EXIT_CODE = 3

E, H, K = 8, 2048, 2


def _stamp(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(repr(time.time()))


#: fault -> (where it strikes, what the rank does there)
_WHERE_WHAT = {
    "none": ("", ""), "exit_after_send": ("send", "exit"),
    "exit_before_dispatch": ("dispatch", "exit"), "stall": ("dispatch", "stall"),
    "slow": ("dispatch", "slow"), "gpu_stall": ("dispatch", "gpu_stall"),
    "exit_before_combine": ("combine", "exit"), "stall_before_combine": ("combine", "stall"),
    "gpu_stall_before_combine": ("combine", "gpu_stall"), "exit_after_combine": ("after", "exit"),
    "stall_after_combine": ("after", "stall"), "gpu_stall_after_combine": ("after", "gpu_stall"),
}


class Fault:
    """Rank ``fail_rank``'s misbehaviour at its ``at``-th ``prepare_async`` (and the
    ``finalize_async`` of that number): install with :meth:`install`, undo with
    :meth:`remove`."""

    def __init__(self, fault: str, at: int, timeout_s: float, stamp_path: str | None):
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.at, self.timeout_s, self.stamp_path = fault, at, timeout_s, stamp_path
        self.where, self.what = _WHERE_WHAT[fault]
        self._prepares = self._finalizes = 0
        self._saved: tuple[Any, Any, tuple[str, str]] | None = None
        self._replay_saved: Any = None

    def install(self, pf: Any, dispatch: str = "prepare_async", combine: str = "finalize_async") -> None:
        """Wrap ``pf``'s methods ``dispatch`` and ``combine`` (as instance attributes)."""
        prepare, finalize = getattr(pf, dispatch), getattr(pf, combine)
        buffer = None
        if self.fault == "exit_after_send":  # a DeepEP backend: its shared buffer's dispatch
            buffer = pf._shared.buffer
            pf._shared.buffer = _SendThenExit(buffer, self)
        self._saved = (pf, buffer, (dispatch, combine))

        def prepare_async(*args: Any, **kwargs: Any) -> Any:
            self._prepares += 1
            if self._prepares == self.at and self.where == "dispatch":
                self._misbehave()
            return prepare(*args, **kwargs)

        def finalize_async(*args: Any, **kwargs: Any) -> Any:
            self._finalizes += 1
            if self._finalizes != self.at or self.where not in ("combine", "after"):
                return finalize(*args, **kwargs)
            if self.where == "combine":
                self._misbehave()
                return finalize(*args, **kwargs)
            return self._after(finalize(*args, **kwargs))

        setattr(pf, dispatch, prepare_async)
        setattr(pf, combine, finalize_async)

    def install_on_graph_replays(self) -> None:
        """Misbehave before this process's ``at``-th CUDA graph replay from now on (wraps
        ``torch.cuda.CUDAGraph.replay`` for the whole process, until :meth:`remove`): a fault in
        the steps a graph replays, where no Python of the backends runs. Faults placed before a
        dispatch only (``exit_before_dispatch``, ``stall``, ``gpu_stall``, ``slow``)."""
        if self.where != "dispatch":
            raise ValueError(f"a fault before a graph replay must be one placed before a dispatch, "
                             f"not {self.fault!r}")
        replay = torch.cuda.CUDAGraph.replay
        replays = 0

        def counted_replay(graph: Any) -> None:
            nonlocal replays
            replays += 1
            if replays == self.at:
                self._misbehave()
            replay(graph)

        torch.cuda.CUDAGraph.replay = counted_replay
        self._replay_saved = replay

    def remove(self) -> None:
        replay = self._replay_saved
        if replay is not None:
            torch.cuda.CUDAGraph.replay = replay
            self._replay_saved = None
        if self._saved is not None:
            pf, buffer, names = self._saved
            for name in names:
                delattr(pf, name)
            if buffer is not None:
                pf._shared.buffer = buffer
            self._saved = None

    def exit(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        _stamp(self.stamp_path)
        os._exit(FAULT_EXIT_CODE)

    def _after(self, out: Any) -> Any:
        """Misbehave once the combine ``out`` (a receiver, a ``(hook, receiver)`` pair or, from a
        synchronous combine, its result) is complete."""
        def receive(receiver: Any) -> Any:
            def after_receiver() -> Any:
                result = receiver()
                self._misbehave()
                return result
            return after_receiver

        if isinstance(out, tuple) and len(out) == 2 and callable(out[1]):
            return out[0], receive(out[1])
        if callable(out):
            return receive(out)
        self._misbehave()
        return out

    def _misbehave(self) -> None:
        if self.what == "exit":
            self.exit()
        elif self.what in ("stall", "slow"):
            _stamp(self.stamp_path)
            time.sleep(self.timeout_s + 2.0 if self.what == "stall" else 0.4 * self.timeout_s)
        elif self.what == "gpu_stall":
            _stamp(self.stamp_path)
            cycles_per_s = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate * 1000
            torch.cuda._sleep(int((self.timeout_s + 3.0) * cycles_per_s))


class _SendThenExit:
    """The real buffer, but the ``at``-th dispatch exits once launched (under a recv hook: in
    place of the hook, i.e. between the send and the receive)."""

    def __init__(self, real: Any, fault: Fault):
        self._real, self._fault, self._dispatches = real, fault, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _dispatch(self, method: str, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self._real, method)(*args, **kwargs)
        self._dispatches += 1
        if self._dispatches != self._fault.at:
            return out
        if kwargs.get("return_recv_hook"):
            return (*out[:-1], self._fault.exit)
        self._fault.exit()
        return out

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch("dispatch", *args, **kwargs)

    def low_latency_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch("low_latency_dispatch", *args, **kwargs)


def error_chain(exc: BaseException | None) -> list[tuple[str, str]]:
    """``(type name, message)`` of ``exc`` and its ``__cause__`` chain."""
    chain = []
    while exc is not None:
        chain.append((type(exc).__name__, str(exc)))
        exc = exc.__cause__
    return chain


def check_survivor(outcome: Any, *, use_dbo: bool, timeout_s: float) -> list[tuple[str, str]]:
    """What a fault test asks of a rank whose peer failed: its job returned (no crash, no hang)
    the result of a step that failed (a dict with ``ok``, ``chain`` as :func:`error_chain` gives
    it, and ``elapsed_s``, as :func:`faulty_step` returns), with a ``CollectiveTimeoutError`` in
    its chain, under DBO a ``UBatchError`` at its head (the failing ubatch unwound the other),
    in about ``timeout_s`` (10x slack for a loaded machine). ``outcome``: the rank's
    :class:`dbo.testing.dist.RankOutcome`. Returns the chain; raises ``AssertionError``."""
    if not outcome.ok:
        raise AssertionError(outcome.traceback)
    res = outcome.value
    if res["ok"]:
        raise AssertionError("a surviving rank finished a step its peer abandoned")
    names = [name for name, _ in res["chain"]]
    if "CollectiveTimeoutError" not in names or (use_dbo and names[0] != "UBatchError"):
        raise AssertionError(res["chain"])
    if not res["elapsed_s"] < 10 * timeout_s:
        raise AssertionError(res)
    return res["chain"]


def fault_inputs(rank: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's seeded tokens and routing, and its local experts' weights, for a fault case:
    ``(x, topk_weights, topk_ids, w1, w2)`` on ``device``."""
    from dbo.experts.reference import local_expert_weights, make_expert_weights
    from dbo.moe.router import topk_route

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(tokens, E, generator=g), K, ids_dtype=torch.int64)
    w1, w2 = make_expert_weights(E, H, 64, dtype=torch.bfloat16, seed=7)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    return tuple(t.to(device) for t in (x, weights, ids, w1, w2))


def make_deepep_backend(kind: str, tokens: int, timeout_s: float, device: torch.device) -> Any:
    """A ``deepep_ht``/``deepep_ll`` backend for :func:`faulty_step`'s shapes."""
    if kind == "ht":
        from dbo.backends import deepep_ht as mod
    else:
        from dbo.backends import deepep_ll as mod
    return mod.make_prepare_finalize(dist.group.WORLD, hidden=H, max_tokens_per_rank=tokens,
                                     num_experts=E, topk=K, dtype=torch.bfloat16, device=device,
                                     timeout_s=timeout_s)


def faulty_step(kind: str, fault: str, use_dbo: bool, fail_rank: int, timeout_s: float, *,
                device: str = "cpu", tokens: int = 32, layers: int = 3,
                stamp_path: str | None = None) -> dict:
    """Run on every rank; see the module docstring. Returns ``ok`` (the faulty step finished),
    ``chain`` (its error chain), ``elapsed_s`` (from the start of the faulty step),
    ``error_time`` (wall clock of the error), ``rel_err`` (finished step vs the reference)."""
    from dbo.experts.reference import relative_error
    from dbo.experts.swiglu import SwiGLUExperts
    from dbo.moe.kernel import MoEKernel

    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    rank = dist.get_rank()
    dev = torch.device(device)
    x, weights, ids, w1, w2 = fault_inputs(rank, tokens, dev)
    pf = make_deepep_backend(kind, tokens, timeout_s, dev)
    kernel = MoEKernel(pf, SwiGLUExperts())

    def layers_of(lo: int, hi: int) -> torch.Tensor:
        h = x[lo:hi]
        for _ in range(layers):
            h = h + kernel(h, w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=E)
        return h

    def step(dbo: bool) -> torch.Tensor:
        if not dbo:
            return layers_of(0, tokens)
        half = tokens // 2
        return torch.cat(run_ubatches([lambda: layers_of(0, half), lambda: layers_of(half, tokens)],
                                      device=None if dev.type == "cuda" else "cpu"))

    reference = step(False)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    # the second layer's first dispatch/combine: ubatch 0's under DBO (after both of layer 0)
    injected = Fault(fault, 3 if use_dbo else 2, timeout_s, stamp_path)
    if rank == fail_rank and fault != "none":
        injected.install(pf)
    t0 = time.monotonic()
    try:
        out = step(use_dbo)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        return {"ok": False, "chain": error_chain(exc), "elapsed_s": time.monotonic() - t0,
                "error_time": time.time(), "rel_err": None}
    finally:
        injected.remove()
    return {"ok": True, "chain": [], "elapsed_s": time.monotonic() - t0, "error_time": None,
            "rel_err": relative_error(out.float(), reference.float())}


def per_launch_check_cost(n: int = 20000) -> dict:
    """Host cost of the checks per launch, in microseconds: the arrival board's fast path (7
    same-host peers already there), the watchdog's event record + hand-over (CUDA), the capture
    check, and the GIL-free deadline that deepep_ht's dispatch runs under."""
    import mmap

    import torch

    from dbo.peers.arrival import ArrivalBoard
    from dbo.peers.watchdog import WATCHDOG, gil_free_deadline

    maps = [mmap.mmap(-1, 64) for _ in range(8)]
    views = {r: memoryview(m).cast("q") for r, m in enumerate(maps)}
    for r in range(1, 8):
        views[r][0] = 1 << 40  # the 7 peers of an 8-GPU host, already there
    board = ArrivalBoard(0, 8, views, {r: os.getpid() for r in range(8)}, [], maps)
    t0 = time.perf_counter()
    for _ in range(n):
        board.missing(board.arrive())
    arrive_us = (time.perf_counter() - t0) / n * 1e6
    site = ("bench", "dispatch", 0, 0)
    # steady state: a warm pool, the events retired by the watchdog thread as they complete
    for _ in range(2):
        for _ in range(n // 10):
            WATCHDOG.record(60.0, site)
        torch.cuda.synchronize()
        time.sleep(3 * WATCHDOG.poll_s)
    watch_us = []
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(n // 10):
            WATCHDOG.record(60.0, site)
        watch_us.append((time.perf_counter() - t0) / (n // 10) * 1e6)
        torch.cuda.synchronize()
        time.sleep(2 * WATCHDOG.poll_s)
    watch_us = statistics.median(watch_us)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda.is_current_stream_capturing()
    capturing_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n // 10):
        with gil_free_deadline(60.0):
            pass
    deadline_us = (time.perf_counter() - t0) / (n // 10) * 1e6
    return {"arrival_fast_path": round(arrive_us, 3), "event_and_watch": round(watch_us, 3),
            "is_capturing": round(capturing_us, 3), "gil_free_deadline": round(deadline_us, 3)}
