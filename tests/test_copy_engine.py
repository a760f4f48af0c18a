"""The copy-engine backend on its CPU transport (host shared memory), 2 and 3 gloo ranks.

The conformance suite (DBO == serial == reference, zero-token ranks and ubatches, hooks,
three ubatches, repeated runs), buffer reuse over many layers, the cross-rank checks, and a
peer that stops mid-step: the waiting rank fails with CollectiveTimeoutError, never hangs.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

from dbo.testing.conformance import check_backend, default_cases, with_options
from dbo.testing.dist import DistWorld

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(180)]


def _make(case):
    from dbo.backends.copy_engine import make_prepare_finalize

    return make_prepare_finalize(dist.group.WORLD, hidden=case.hidden,
                                 max_tokens_per_rank=case.max_tokens_per_rank,
                                 num_experts=case.num_experts, topk=case.topk, dtype=case.dtype,
                                 device="cpu", num_ubatches=case.num_ubatches, timeout_s=20.0,
                                 **dict(case.options))


def test_conformance_2_ranks(world2):
    cases = default_cases(2)
    base = cases[1]
    cases += [
        dataclasses.replace(base, name="fp32", dtype=torch.float32, tol_ref=1e-4, tol_dbo=1e-5),
        dataclasses.replace(base, name="topk 8 of 16", topk=8, num_experts=16, seed=21),
        dataclasses.replace(base, name="hidden 2048", hidden=2048, seed=22),
        dataclasses.replace(base, name="both ranks empty", num_tokens=(0, 0), seed=23),
        # fp8 dispatch: against the bf16 reference within fp8's rounding, overlapped == plain
        with_options(dataclasses.replace(base, name="fp8 dispatch", hidden=256, seed=24, tol_ref=6e-2),
                     use_fp8_dispatch=True),
        with_options(dataclasses.replace(base, name="fp8 to the experts", hidden=256, seed=25, tol_ref=6e-2),
                     use_fp8_dispatch=True, dequantize_received=False),
        with_options(dataclasses.replace(base, name="fp8, fp32 activations", hidden=128, seed=26,
                                         dtype=torch.float32, tol_ref=6e-2),
                     use_fp8_dispatch=True),
    ]
    check_backend(world2, _make, cases)


def test_conformance_3_ranks(world3):
    cases = [c for c in default_cases(3, num_experts=12)]
    check_backend(world3, _make, cases)


def test_destinations_ring_and_rank_order():
    from dbo.backends.copy_engine import destinations

    assert destinations(2, 4) == [2, 3, 0, 1]
    assert destinations(2, 4, "rank") == [0, 1, 2, 3]
    for w in range(1, 9):  # at each step of the ring, the ranks write into different peers
        steps = list(zip(*(destinations(r, w) for r in range(w)), strict=True))
        assert all(sorted(step) == list(range(w)) for step in steps)
    with pytest.raises(ValueError, match="put_order"):
        destinations(0, 2, "random")


def _orders_agree() -> float:
    """The same MoE call through a ring-order and a rank-order backend: the same bits."""
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
    from dbo.moe import MoEKernel, topk_route
    from dbo.ubatch.context import run_ubatches

    rank, world = dist.get_rank(), dist.get_world_size()
    w1, w2 = make_expert_weights(4 * world, 64, 32, dtype=torch.float32, seed=4)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    x = torch.randn(20 + 5 * rank, 64, generator=torch.Generator().manual_seed(rank))
    weights, ids = topk_route(x @ torch.randn(64, 4 * world, generator=torch.Generator().manual_seed(6)), 3)
    outs = []
    for order in ("ring", "rank"):
        pf = CopyEnginePrepareAndFinalize(hidden_size=64, max_tokens_per_rank=32, max_topk=3,
                                          dtype=torch.float32, device="cpu", timeout_s=20.0,
                                          put_order=order)
        assert pf.put_order == order
        kernel = MoEKernel(pf, SwiGLUExperts())

        def call(lo, hi, kernel=kernel):
            return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=4 * world)

        outs.append(call(0, x.shape[0]))
        outs.append(torch.cat(run_ubatches([lambda: call(0, 9), lambda: call(9, x.shape[0])])))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    return float((outs[0] - outs[1]).abs().max())


def test_put_orders_give_the_same_bits(world3):
    assert max(world3.run(_orders_agree)) < 1e-5


def _many_layers(layers: int, per_layer_backends: bool = False) -> float:
    """``layers`` MoE layers in a row on one backend, or on one backend per layer sharing one
    transport (buffers reused either way), DBO vs serial."""
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize
    from dbo.backends.copy_engine.transport import TRANSPORTS
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
    from dbo.moe import MoEKernel, topk_route
    from dbo.ubatch.context import run_ubatches

    rank, world = dist.get_rank(), dist.get_world_size()

    def backend():
        return CopyEnginePrepareAndFinalize(hidden_size=64, max_tokens_per_rank=32, max_topk=2,
                                            dtype=torch.float32, device="cpu", timeout_s=20.0)

    TRANSPORTS.reset()
    kernels = [MoEKernel(backend(), SwiGLUExperts()) for _ in range(layers if per_layer_backends else 1)]
    assert len({id(k.prepare_finalize.transport) for k in kernels}) == 1  # one set of buffers
    assert len(TRANSPORTS) == 1
    w1, w2 = make_expert_weights(4 * world, 64, 32, dtype=torch.float32, seed=3)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(30 - 7 * rank, 64, generator=g)
    router = torch.randn(64, 4 * world, generator=torch.Generator().manual_seed(5))

    def layer(h, i):  # bounded, so that twelve layers neither overflow nor vanish
        weights, ids = topk_route(h @ router, 2)
        kernel = kernels[i % len(kernels)]
        return torch.tanh(h + kernel(h, w1, w2, weights, ids, global_num_experts=4 * world))

    def run(h, n):
        for i in range(n):
            h = layer(h, i)
        return h

    serial = run(x, layers)
    cut = x.shape[0] // 2
    parts = run_ubatches([lambda: run(x[:cut], layers), lambda: run(x[cut:], layers)])
    dbo = torch.cat(parts)
    err = float((dbo - serial).abs().max())
    TRANSPORTS.reset()
    assert len(TRANSPORTS) == 0
    return err


@pytest.mark.parametrize("per_layer_backends", [False, True])
def test_buffers_reused_across_layers(world2, per_layer_backends):
    assert max(world2.run(_many_layers, 12, per_layer_backends)) < 1e-4


def _disagree(field: str) -> str:
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize

    rank = dist.get_rank()
    pf = CopyEnginePrepareAndFinalize(hidden_size=32, max_tokens_per_rank=8, max_topk=2,
                                      dtype=torch.float32, device="cpu", timeout_s=10.0,
                                      check_inputs=False)
    m = 4
    topk = 3 if field == "topk" else 2
    x = torch.randn(m, 32)
    ids = torch.zeros(m, topk, dtype=torch.int64)
    w = torch.ones(m, topk)
    num_experts = 4 + 2 * rank if field == "experts" else 4
    try:
        pf.prepare_async(x, w, ids, num_experts, None, False)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("field,words", [("topk", "topk=3 exceeds max_topk=2"),
                                         ("experts", "num_experts differs across ranks")])
def test_every_rank_raises_the_same_error(world2, field, words):
    msgs = world2.run(_disagree, field)
    assert msgs[0] == msgs[1] and words in msgs[0], msgs


def _self_sizing(counts: list[list[int]]) -> dict:
    """Layers whose token counts (per call, per rank) grow and shrink, on backends built without
    max_tokens_per_rank: DBO and serial equal the single-process reference; the slots grow."""
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize
    from dbo.backends.copy_engine.transport import TRANSPORTS
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights, reference_moe
    from dbo.moe import MoEKernel, topk_route
    from dbo.ubatch.context import run_ubatches

    rank, world = dist.get_rank(), dist.get_world_size()
    TRANSPORTS.reset()
    kernels = [MoEKernel(CopyEnginePrepareAndFinalize(hidden_size=32, max_topk=2, dtype=torch.float32,
                                                      device="cpu", timeout_s=20.0), SwiGLUExperts())
               for _ in range(2)]  # two layers, one shared transport
    transport = kernels[0].prepare_finalize.transport
    assert transport.total_bytes == 0  # nothing allocated before the first dispatch
    w1f, w2f = make_expert_weights(2 * world, 32, 16, dtype=torch.float32, seed=4)
    w1, w2 = local_expert_weights(w1f, rank, world), local_expert_weights(w2f, rank, world)
    router = torch.randn(32, 2 * world, generator=torch.Generator().manual_seed(6))
    capacities, worst = [], 0.0

    def run(h):
        for kernel in kernels:
            weights, ids = topk_route(h @ router, 2)
            h = kernel(h, w1, w2, weights, ids, global_num_experts=2 * world)
        return h

    def reference(h):
        for _ in kernels:
            weights, ids = topk_route(h @ router, 2)
            h = reference_moe(h, w1f, w2f, weights, ids)
        return h

    for step, per_rank in enumerate(counts):
        x = torch.randn(per_rank[rank], 32, generator=torch.Generator().manual_seed(step * 10 + rank))

        want = reference(x)
        serial = run(x)
        cut = x.shape[0] // 2
        halves = (x[:cut], x[cut:])
        dbo = torch.cat(run_ubatches([lambda h=h: run(h) for h in halves]))
        if x.shape[0]:
            worst = max(worst, float((serial - want).abs().max()), float((dbo - want).abs().max()))
        capacities.append([transport.capacity(s) for s in range(transport.num_slots)])
    TRANSPORTS.reset()
    return {"err": worst, "capacities": capacities}


def test_buffers_size_themselves_and_grow(world2):
    # per step: tokens of rank 0 and rank 1 (serial calls use slot 0 with all of them; the DBO
    # ubatches use slots 0 and 1 with halves); a zero-token rank; a shrink; two growths
    counts = [[3, 5], [0, 2], [20, 9], [4, 4], [70, 1]]
    results = world2.run(_self_sizing, counts)
    assert max(r["err"] for r in results) < 1e-4, results
    assert results[0]["capacities"] == results[1]["capacities"]  # every rank decided the same
    caps = results[0]["capacities"]
    assert caps[0] == [16, 16]  # the first call needs 5 per rank, ubatch slots 3: rounded to 16
    assert caps[2] == [32, 16]  # 20 tokens: at least double
    assert caps[3] == caps[2]  # smaller calls reuse the buffers
    assert caps[4] == [70 + 10, 48]  # 70 > 2 * 32 (rounded up to 16); slot 1 needs 35: 2 * 16 < 35


def _stop_mid_step(stopper: int, block: bool = False, how: str = "stall", release: str = "") -> float:
    # block: the backend's own timeout is 60 s, a collective_timeout(2.0) block around the step
    # sets the one in force; how: the stopper stalls (its process runs on, until the waiting rank
    # has given up and made the file ``release``, at most 30 s) or exits
    import contextlib

    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize
    from dbo.errors import CollectiveTimeoutError
    from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
    from dbo.moe import MoEKernel, topk_route
    from dbo.peers.watchdog import collective_timeout

    rank, world = dist.get_rank(), dist.get_world_size()
    pf = CopyEnginePrepareAndFinalize(hidden_size=32, max_tokens_per_rank=16, max_topk=2,
                                      dtype=torch.float32, device="cpu", timeout_s=60.0 if block else 2.0)
    scope = collective_timeout(2.0) if block else contextlib.nullcontext()
    kernel = MoEKernel(pf, SwiGLUExperts())
    w1, w2 = make_expert_weights(2 * world, 32, 16, dtype=torch.float32, seed=1)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    h = torch.randn(16, 32)
    t0 = time.monotonic()
    try:
        with scope:
            for layer in range(4):
                if rank == stopper and layer == 2:  # mid-step, between two layers
                    if how == "stall":
                        deadline = time.monotonic() + 30.0
                        while not os.path.exists(release) and time.monotonic() < deadline:
                            time.sleep(0.05)
                    os._exit(3)
                weights, ids = topk_route(torch.randn(16, 2 * world), 2)
                h = kernel(h, w1, w2, weights, ids, global_num_experts=2 * world)
    except CollectiveTimeoutError as exc:
        want = "died or fell out of step" if how == "stall" else "exited"
        assert "rank 1" in str(exc) and want in str(exc), exc
        return time.monotonic() - t0
    finally:
        if release and rank != stopper:  # the waiting rank is done: the stalled one may go
            open(release, "w").close()
    return -1.0


@pytest.mark.parametrize("block", [False, True], ids=["backend timeout", "collective_timeout block"])
def test_a_stalled_peer_fails_the_waiting_rank_within_the_timeout(tmp_path, block):
    with DistWorld(2) as world:
        outcomes = world.run_outcomes(_stop_mid_step, 1, block, "stall", str(tmp_path / "released"),
                                      timeout_s=45.0)
    assert outcomes[1].exitcode == 3 or not outcomes[1].ok
    assert outcomes[0].ok, outcomes[0].traceback
    # the 2 s timeout (not the backend's 60 s in the block case), with 10x slack above
    assert 1.5 < outcomes[0].value < 20.0, outcomes[0].value


def test_a_dead_peer_fails_the_waiting_rank_before_the_timeout():
    # the host board knows the peers' processes: one that exited ends the wait at once
    with DistWorld(2) as world:
        outcomes = world.run_outcomes(_stop_mid_step, 1, False, "exit", timeout_s=30.0)
    assert outcomes[1].exitcode == 3 or not outcomes[1].ok
    assert outcomes[0].ok, outcomes[0].traceback
    assert 0 < outcomes[0].value < 1.5, outcomes[0].value  # well under the 2 s timeout


def _bad_args() -> list[str]:
    from dbo.backends.copy_engine import CopyEnginePrepareAndFinalize

    msgs = []
    for kwargs in ({"hidden_size": 0, "max_tokens_per_rank": 4},
                   {"hidden_size": 8, "max_tokens_per_rank": -1},
                   {"hidden_size": 8, "max_tokens_per_rank": 4, "dtype": torch.int8},
                   {"hidden_size": 8, "max_tokens_per_rank": 4, "device": "meta"},
                   {"hidden_size": 8, "max_tokens_per_rank": 4, "put_order": "random"}):
        try:
            CopyEnginePrepareAndFinalize(device=kwargs.pop("device", "cpu"), **kwargs)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_constructor_arguments(world2):
    msgs = world2.run(_bad_args)[0]
    assert len(msgs) == 5, msgs
    assert "hidden_size" in msgs[0] and "max_tokens_per_rank" in msgs[1]
    assert "dtype" in msgs[2] and "cuda or cpu" in msgs[3] and "put_order" in msgs[4]


def test_gpu_signal_waits_take_the_timeout_in_force():
    # the CUDA transport's put_signal/wait_signal limit: its own timeout_s, or the innermost
    # collective_timeout() (checked without a GPU: the arithmetic only)
    import inspect

    from dbo.backends.copy_engine.transport import CudaTransport
    from dbo.peers.watchdog import collective_timeout

    assert "self.timeout_s = timeout_s" in inspect.getsource(CudaTransport.__init__)
    t = object.__new__(CudaTransport)
    t.timeout_s = 60.0
    assert t._timeout_ms() == 60_000
    with collective_timeout(2.5):
        assert t._timeout_ms() == 2_500
    with collective_timeout(0.0001):
        assert t._timeout_ms() == 1


def test_a_new_signal_pad_is_zeroed_before_the_peers_see_it(monkeypatch):
    # The allocation's zeroing of the signal pad may still be queued on the GPU when it returns;
    # a peer that signalled before it ran would lose that signal. The device is synchronized
    # between the allocation and the rendezvous that shows the pad to the peers (checked without
    # a GPU: the order of the calls).
    import torch.distributed._symmetric_memory as symm_mem

    from dbo.backends.copy_engine.transport import symm_mem_rendezvous

    calls = []
    monkeypatch.setattr(symm_mem, "empty", lambda n, **kw: calls.append("empty") or torch.zeros(n))
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buf, group: calls.append("rendezvous") or "h")
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    group = type("G", (), {"group_name": "g"})()
    buf, handle = symm_mem_rendezvous(64, torch.device("cpu"), group)
    assert handle == "h" and buf.numel() == 64
    assert calls == ["empty", "synchronize", "rendezvous"]
