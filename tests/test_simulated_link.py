"""The simulated link (``dbo.backends.simulated_link``): the model's arithmetic, and that a
backend under it gives the same bits while a transfer takes at least the modelled time, plain
and as overlapped ubatches (single process and 2 gloo ranks)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from dbo.backends.local import LocalPrepareAndFinalize
from dbo.backends.simulated_link import SimulatedLink, SimulatedLinkPrepareAndFinalize
from dbo.experts import SwiGLUExperts, local_expert_weights, make_expert_weights
from dbo.moe import MoEKernel, topk_route
from dbo.overlap import mask_current_padding, overlapped_forward
from dbo.split import SplitConfig
from dbo.testing.dist import DistWorld
from dbo.ubatch.context import run_ubatches


def test_model_arithmetic():
    link = SimulatedLink(50, 5, 0.875)
    assert link.transfer_us(0) == 5
    assert link.transfer_us(50e3) == pytest.approx(5 + 0.875)  # 50 kB at 50 GB/s = 1 us
    assert SimulatedLink.parse("25,10", 0.5) == SimulatedLink(25, 10, 0.5)
    assert SimulatedLink.parse("40") == SimulatedLink(40, 0, 1.0)
    for bad in ("", "x", "1,2,3,4", ",5", "deepep-xx"):
        with pytest.raises(ValueError, match="GBPS"):
            SimulatedLink.parse(bad)
    for kw in ({"gbps": 0}, {"gbps": 1, "latency_us": -1}, {"gbps": 1, "remote_fraction": 1.5}):
        with pytest.raises(ValueError):
            SimulatedLink(**kw)
    assert "formula" in link.as_dict() and "50 GB/s" in link.describe()
    assert link.as_dict()["wait_clock"] in ("global timer", "SM cycles")
    assert link.as_dict()["wait_clock"] in link.describe()
    kw = dict(tokens=10, topk=2, world_size=4, num_experts=8, hidden=3, elem_bytes=2)
    assert SimulatedLink.expected_bytes("copy_engine", **kw) == 10 * 3 * 6
    assert SimulatedLink.expected_bytes("naive", **kw) == 10 * 3 * 6
    assert SimulatedLink.expected_bytes("deepep_ll", **kw) == pytest.approx(10 * 2 * 3 / 4 * 6)
    # another rank holds 2 of the 8 experts: a token misses it with probability C(6,2)/C(8,2)
    hit = 1 - math.comb(6, 2) / math.comb(8, 2)
    assert SimulatedLink.expected_bytes("all2all", **kw) == pytest.approx(10 * 3 * hit * 6)
    assert SimulatedLink.expected_bytes("deepep_ht", **{**kw, "world_size": 1}) == 0


def _inputs(rank: int, world: int, dtype=torch.float32):
    w1, w2 = make_expert_weights(4 * world, 64, 32, dtype=dtype, seed=7)
    w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
    x = torch.randn(24 + 4 * rank, 64, generator=torch.Generator().manual_seed(rank)).to(dtype)
    router = torch.randn(64, 4 * world, generator=torch.Generator().manual_seed(8)).to(dtype)
    weights, ids = topk_route(x @ router, 2)
    return x, w1, w2, weights, ids


def _calls(kernel: MoEKernel, x, w1, w2, weights, ids, experts: int):
    def call(lo, hi):
        return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=experts)

    plain = call(0, x.shape[0])
    cut = x.shape[0] // 2
    dbo = torch.cat(run_ubatches([lambda: call(0, cut), lambda: call(cut, x.shape[0])]))
    return plain, dbo


def test_local_backend_same_bits_and_held_back():
    x, w1, w2, weights, ids = _inputs(0, 1)
    want = _calls(MoEKernel(LocalPrepareAndFinalize(), SwiGLUExperts()), x, w1, w2, weights, ids, 4)
    link = SimulatedLink(1000, latency_us=20_000)
    pf = SimulatedLinkPrepareAndFinalize(LocalPrepareAndFinalize(), link, "local")
    kernel = MoEKernel(pf, SwiGLUExperts())
    t0 = time.perf_counter()
    got = _calls(kernel, x, w1, w2, weights, ids, 4)
    took = time.perf_counter() - t0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert sorted(p for p, _ in pf.modelled_us) == ["combine"] * 3 + ["dispatch"] * 3
    # plain: dispatch then combine (2 x 20 ms); DBO: the two ubatches' waits overlap (>= 2 x 20 ms)
    assert took >= 4 * 0.020
    with pytest.raises(TypeError, match="SimulatedLink"):
        SimulatedLinkPrepareAndFinalize(LocalPrepareAndFinalize(), "50,5", "local")


def test_an_fp8_dispatch_is_modelled_with_its_bytes():
    # a backend that dispatches fp8 (use_fp8_dispatch) moves 1 + 4/128 bytes an element out and
    # the combine's dtype back: the model charges each its own
    class FourRanksFp8(LocalPrepareAndFinalize):
        use_fp8_dispatch = True

        def num_dispatchers(self) -> int:
            return 4

    x, w1, w2, weights, ids = _inputs(0, 1, dtype=torch.bfloat16)
    link = SimulatedLink(1000, latency_us=0)
    pf = SimulatedLinkPrepareAndFinalize(FourRanksFp8(), link, "copy_engine")
    MoEKernel(pf, SwiGLUExperts())(x, w1, w2, weights, ids, global_num_experts=4)
    (phase_d, us_d), (phase_c, us_c) = pf.modelled_us
    assert (phase_d, phase_c) == ("dispatch", "combine")
    assert us_c == pytest.approx(x.shape[0] * 3 * 64 * 2 / 1e6)  # every token to 3 peers, bf16
    assert us_d == pytest.approx(us_c * (1 + 4 / 128) / 2)


def _under_link(backend: str) -> tuple[float, float, float]:
    from dbo.backends import make_backend

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w1, w2, weights, ids = _inputs(rank, world)

    def build(link=None):
        return make_backend(backend, None, hidden=64, num_experts=4 * world, topk=2, dtype=torch.float32,
                            device="cpu", max_tokens_per_rank=64, link=link)

    want = _calls(MoEKernel(build(), SwiGLUExperts()), x, w1, w2, weights, ids, 4 * world)
    link = SimulatedLink(0.01, latency_us=5_000, remote_fraction=0.5)  # 10 MB/s: bytes dominate
    pf = build(link)
    assert isinstance(pf, SimulatedLinkPrepareAndFinalize) and pf.name == f"{backend}+link"
    kernel = MoEKernel(pf, SwiGLUExperts())
    dist.barrier()
    t0 = time.perf_counter()
    plain = kernel(x, w1, w2, weights, ids, global_num_experts=4 * world)
    took = time.perf_counter() - t0
    modelled = sum(us for _, us in pf.modelled_us) * 1e-6
    got = _calls(kernel, x, w1, w2, weights, ids, 4 * world)
    same = all(torch.equal(g, w) for g, w in zip((plain, *got), (want[0], *want), strict=True))

    # the overlapped forward over the link: the same numbers as the plain forward
    router = torch.randn(64, 4 * world, generator=torch.Generator().manual_seed(8))

    def layer(h):
        weights_h, ids_h = topk_route(h @ router, 2)
        ids_h, weights_h = mask_current_padding(ids_h, weights_h)
        return kernel(h, w1, w2, weights_h, ids_h, global_num_experts=4 * world)

    wrapped = overlapped_forward(layer, x, config=SplitConfig(prefill_token_threshold=2,
                                                              decode_token_threshold=2))
    same = same and torch.allclose(wrapped, layer(x), rtol=1e-5, atol=1e-6)
    return float(same), took, modelled


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["naive", "all2all", "copy_engine"])
def test_backends_under_the_link_give_the_same_bits_and_take_the_modelled_time(backend):
    with DistWorld(2) as world:
        results = world.run(_under_link, backend)
    for same, took, modelled in results:
        assert same == 1.0
        assert modelled > 2 * 0.005  # dispatch and combine, each past its latency by its bytes
        assert took >= modelled


def test_wall_wait_rounds_and_chunks(monkeypatch):
    # one compiled kernel for every length (a multiple of 16 ns), long waits in several launches,
    # and a clear error where Triton cannot run it
    from dbo.backends.simulated_link import wall_wait as _wall_wait
    from dbo.kernels import triton_launch

    launched = []
    monkeypatch.setattr(_wall_wait, "AVAILABLE", True)
    monkeypatch.setattr(_wall_wait, "_wait_wall_kernel", "kernel", raising=False)
    monkeypatch.setattr(triton_launch, "launch", lambda k, grid, args, kw: launched.append(args[0]))
    _wall_wait.wait_wall_ns(1)
    _wall_wait.wait_wall_ns(5_000)
    _wall_wait.wait_wall_ns(2 * _wall_wait.MAX_NS + 32)
    assert launched == [16, 5_008, _wall_wait.MAX_NS, _wall_wait.MAX_NS, 32]
    assert all(n % 16 == 0 for n in launched)
    monkeypatch.setattr(_wall_wait, "AVAILABLE", False)
    with pytest.raises(RuntimeError, match="needs Triton"):
        _wall_wait.wait_wall_ns(100)


def test_link_wait_clock_can_be_chosen(monkeypatch):
    from dbo.backends.simulated_link import wait_clock
    from dbo.backends.simulated_link import wall_wait as _wall_wait

    monkeypatch.setattr(_wall_wait, "AVAILABLE", True)
    assert wait_clock() == "global timer"
    monkeypatch.setenv("DBO_LINK_WAIT_CLOCK", "cycles")
    assert wait_clock() == "SM cycles"
    monkeypatch.delenv("DBO_LINK_WAIT_CLOCK")
    monkeypatch.setattr(_wall_wait, "AVAILABLE", False)
    assert wait_clock() == "SM cycles"
