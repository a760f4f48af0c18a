"""GPU waits timed on the GPU's global timer (nanoseconds), not on SM clock cycles: a plain wait,
and a NIC flow's wait (:func:`nic_flow`, the model of :mod:`dbo.backends.simulated_link.nic`).

``torch.cuda._sleep`` spins a number of SM cycles. Its length in time follows the SM clock,
which drops when the GPU is loaded (power cap, heat): a wait calibrated on an idle GPU ran 8-20%
long beside a DBO step's GEMMs. :func:`wait_wall_ns` queues one program of one warp that reads
the ``%globaltimer`` register until the given nanoseconds have passed since it started, so its
length is the same however busy the SMs are. Needs Triton; :data:`AVAILABLE` says whether it is
there (the caller falls back to the cycle count).
"""

from __future__ import annotations

import os

import torch

__all__ = ["AVAILABLE", "MAX_NS", "wait_wall_ns", "nic_flow"]

#: the longest wait one launch takes (an int32 argument: one specialization for every length)
MAX_NS = 2**31 - 16

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    AVAILABLE = os.environ.get("TRITON_INTERPRET", "0") != "1"
except ImportError:  # pragma: no cover - the CPU install has no Triton
    AVAILABLE = False

if AVAILABLE:
    @triton.jit
    def _wait_wall_kernel(ns):
        t0 = globaltimer()
        t = t0
        while t - t0 < ns:
            t = globaltimer()

    @triton.jit
    def _lock(state):
        zero = tl.full((), 0, tl.int64)
        while tl.atomic_cas(state, zero, zero + 1) != 0:
            pass

    @triton.jit
    def _unlock(state):
        tl.atomic_xchg(state, tl.full((), 0, tl.int64))

    @triton.jit
    def _nic_flow_kernel(state, count_ptr, begun_ptr, unit_q, rate_q, fixed_ns, poll_ns):
        # state: [lock, flows sending, last update (ns), bytes served per flow so far (x 1024)];
        # processor sharing: while n flows send, each is served rate / n, so the bytes served per
        # flow grow by dt * rate / n; a flow that joined when they stood at v is done at v + need
        start = globaltimer()
        need = tl.load(count_ptr) * unit_q
        if need > 0:
            _lock(state)
            now = globaltimer()
            n = tl.load(state + 1, volatile=True)
            last = tl.load(state + 2, volatile=True)
            v = tl.load(state + 3, volatile=True)
            if n > 0:
                v += (now - last) * rate_q // n
            tl.store(state + 1, n + 1)
            tl.store(state + 2, now)
            tl.store(state + 3, v)
            _unlock(state)
            target = v + need
            sending = 1
            while sending == 1:
                _lock(state)
                now = globaltimer()
                n = tl.load(state + 1, volatile=True)
                last = tl.load(state + 2, volatile=True)
                v = tl.load(state + 3, volatile=True) + (now - last) * rate_q // n
                if v >= target:
                    sending = 0
                    n -= 1
                tl.store(state + 1, n)
                tl.store(state + 2, now)
                tl.store(state + 3, v)
                _unlock(state)
                if sending == 1:
                    # until this flow's end if no flow joins or leaves meanwhile, at most poll_ns
                    until = now + tl.minimum((target - v) * n // rate_q + 1, poll_ns)
                    t = globaltimer()
                    while t < until:
                        t = globaltimer()
        # the fixed cost is a latency counted from the call's start, where the call stamped it:
        # the time between that and this flow's start (the call's own work) is part of it
        fixed = tl.full((), 0, tl.int64) + fixed_ns  # (an int argument of 1 is a constexpr)
        begun = tl.load(begun_ptr)
        if begun > 0:
            fixed = tl.maximum(fixed - (start - begun), 0)
        t0 = globaltimer()
        t = t0
        while t - t0 < fixed:
            t = globaltimer()


def nic_flow(state, count, begun=None, *, unit_q: int, rate_q: int, fixed_ns: int, poll_ns: int = 2000
             ) -> None:
    """Queue one NIC flow's wait on the current CUDA stream: ``count[0] * unit_q / 1024`` bytes
    served by processor sharing at ``rate_q / 1024`` bytes per ns among the flows of ``state``
    (int64 ``[4]``, zeros at first, one per link), then ``fixed_ns``. One warp; the flows poll
    the shared state at most every ``poll_ns`` (a flow that ends is seen within that).

    ``begun``: a ``[1]`` int64 tensor holding the global timer (ns) when the flow's call began
    (0: unknown, the fixed cost starts after the bytes); the fixed cost then counts from there,
    less what has passed before the flow starts, none below zero."""
    if not AVAILABLE:
        raise RuntimeError("nic_flow needs Triton, not importable here or run by its interpreter")
    from dbo.kernels.triton_launch import launch

    if begun is None:
        begun = torch.zeros(1, dtype=torch.int64, device=count.device)
    launch(_nic_flow_kernel, (1,), (state, count, begun, int(unit_q), max(int(rate_q), 1),
                                   max(int(fixed_ns), 0), int(poll_ns)), {"num_warps": 1})


def wait_wall_ns(ns: int) -> None:
    """Queue a wait of ``ns`` nanoseconds on the current CUDA stream (rounded up to 16 ns; a wait
    past :data:`MAX_NS` is queued as several launches). Costs the host one kernel launch, the GPU
    one warp for that long."""
    if not AVAILABLE:
        raise RuntimeError("wait_wall_ns needs Triton, not importable here or run by its "
                           "interpreter")
    from dbo.kernels.triton_launch import launch

    # rounded up to a multiple of 16: Triton specializes an integer on its divisibility by 16,
    # so every length runs the one compiled kernel
    left = -(-max(int(ns), 1) // 16) * 16
    while left > 0:
        step = min(left, MAX_NS)
        launch(_wait_wall_kernel, (1,), (step,), {"num_warps": 1})
        left -= step
