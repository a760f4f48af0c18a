"""The emulated rank and the NIC-like link on one GPU: the flows' arrivals against the model
(:func:`dbo.backends.simulated_link.nic.serve`), in the GPU's order and sharing the rate, eager
and replayed from a CUDA graph; the emulated rank's layer against the single-process reference
with the remapped routing, overlapped against plain, and a captured low-latency step against
eager. Run on the GPU host: ``pytest tests/gpu/test_emulated_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from dbo.backends import make_backend
from dbo.backends.emulated import EMULATED
from dbo.backends.simulated_link import SimulatedLink
from dbo.backends.simulated_link import wall_wait as _wall_wait
from dbo.backends.simulated_link.nic import NIC_GPU, Flow, serve
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
from dbo.moe import MoEKernel
from dbo.moe.validate import stand_in_local_ids
from dbo.ubatch.context import run_ubatches
from dbo.ubatch.streams import gpu_sleep

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not _wall_wait.AVAILABLE, reason="needs Triton")]

GBPS = 10.0  # 1e4 bytes per us: 1 MB = 100 us


def _flows(readies_us: list[float], nbytes: list[float], fixed_us: float, order: list[int]
           ) -> tuple[list[float], list[float]]:
    """Queue flows in host ``order``, flow i ready about ``readies_us[i]`` after a common start
    (a GPU sleep on a stream of its own). The GPU is held by a long sleep while the host queues
    everything, so host launch time is not in the figures. Returns each flow's measured ready
    time and arrival after the start, us."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    gpu_sleep(20.0)  # the host queues the rest meanwhile
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    side = [torch.cuda.Stream() for _ in readies_us]
    after = [torch.cuda.Stream() for _ in readies_us]
    ready_ev: dict[int, torch.cuda.Event] = {}
    done_ev: dict[int, torch.cuda.Event] = {}
    for i in order:
        side[i].wait_event(start)
        with torch.cuda.stream(side[i]):
            if readies_us[i] > 0:
                gpu_sleep(readies_us[i] / 1e3)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        ready_ev[i] = ready
        done = NIC_GPU.flow(dev, ready, gbps=GBPS, fixed_us=fixed_us, nbytes=nbytes[i])
        after[i].wait_event(done)
        timed = torch.cuda.Event(enable_timing=True)
        timed.record(after[i])
        done_ev[i] = timed
    torch.cuda.synchronize()
    n = len(readies_us)
    return ([start.elapsed_time(ready_ev[i]) * 1e3 for i in range(n)],
            [start.elapsed_time(done_ev[i]) * 1e3 for i in range(n)])


def test_flows_share_the_rate_and_start_when_ready_not_in_host_order():
    _flows([0.0], [1e4], 0.0, [0])  # warm-up: compile
    # two flows of 1 MB ready together: both at ~220 us (not 120 and 220)
    # (each arrival also carries two cross-stream handoffs, the flow's start behind its ready
    # event and the receiver's wait behind its end: about 5 us each)
    ready, got = _flows([0.0, 0.0], [1e6, 1e6], 20.0, [0, 1])
    want = serve([Flow(r, 1e6, 20.0) for r in ready], GBPS)
    assert got == pytest.approx(want, rel=0.05, abs=15), (ready, got, want)
    # the host queues the late flow first: the early one still goes first, at the full rate
    ready, got = _flows([400.0, 0.0], [1e6, 1e6], 0.0, [0, 1])
    want = serve([Flow(r, 1e6) for r in ready], GBPS)
    assert got == pytest.approx(want, rel=0.05, abs=15), (ready, got, want)
    assert got[1] < got[0]


def test_flows_replay_from_a_cuda_graph():
    dev = torch.device("cuda")
    count = torch.full((1,), 1000, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        ready = torch.cuda.Event()
        ready.record()
        NIC_GPU.flow(dev, ready, gbps=GBPS, fixed_us=10.0, count=count, bytes_per_count=1000.0)  # warm-up
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            ready = torch.cuda.Event()
            ready.record()
            done = NIC_GPU.flow(dev, ready, gbps=GBPS, fixed_us=10.0, count=count, bytes_per_count=1000.0)
            torch.cuda.current_stream().wait_event(done)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    medians = []
    for n in (1000, 3000):  # 1 MB then 3 MB, read from the device at each replay
        count.fill_(n)
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        medians.append(sorted(times)[2])
    # the replay's own launch adds a few us; the bytes' slope is the rate
    assert medians[0] == pytest.approx(110, abs=20), medians
    assert medians[1] - medians[0] == pytest.approx(200, rel=0.05), medians


def test_the_fixed_cost_counts_from_the_calls_stamp():
    from dbo.backends.emulated import kernels

    dev = torch.device("cuda")
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    share = torch.zeros(1, dtype=torch.int64, device=dev)

    def arrival(stamped: bool) -> float:
        begun = torch.empty(1, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        gpu_sleep(20.0)  # the host queues the rest meanwhile
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        kernels.ll_remote_units(ids, share, 1, begun=begun)  # stamps the call's start
        gpu_sleep(0.03)  # the call's own work: 30 us
        ready = torch.cuda.Event()
        ready.record()
        done = NIC_GPU.flow(dev, ready, gbps=GBPS, fixed_us=50.0, nbytes=1e5,
                            begun=begun if stamped else None)
        torch.cuda.current_stream().wait_event(done)
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    arrival(True)  # warm-up: compile
    # 30 us of own work, 10 us of bytes, then the fixed cost: 50 us from the stamp (20 left), or
    # 50 us after the bytes without it; plus the handoffs
    stamped, plain = arrival(True), arrival(False)
    assert 55 < stamped < 75, (stamped, plain)
    assert 85 < plain < 110, (stamped, plain)


def test_a_device_count_freed_by_its_maker_is_not_reused_before_the_flow_reads_it():
    import time

    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gpu_sleep(20.0)  # the flow starts 20 ms from now
        ready = torch.cuda.Event()
        ready.record()
    count = torch.full((1,), 1024, dtype=torch.int64, device=dev)  # 1 kB
    done = NIC_GPU.flow(dev, ready, gbps=GBPS, fixed_us=0.0, count=count, bytes_per_count=1.0)
    del count
    # the allocator would hand the freed block to the next allocation of this stream: a count of
    # 2**40 kB, a flow of days
    junk = torch.full((1,), 2**40, dtype=torch.int64, device=dev)
    deadline = time.monotonic() + 5.0
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done.query(), "the flow read a reused count"
    del junk


def _layer(layout: str, n: int, t: int, link: SimulatedLink | None, seed: int = 0):
    torch.manual_seed(seed)
    hidden, inter, experts, topk = 2048, 256, 64, 8
    n_local = experts // n
    pf = make_backend("emulated", None, hidden=hidden, num_experts=experts, topk=topk, dtype=torch.bfloat16,
                      device="cuda", max_tokens_per_rank=t, ep_size=n, rank=n - 1, layout=layout, link=link)
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(n_local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.03
    w2 = torch.randn(n_local, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.03
    weights, ids = torch.topk(torch.softmax(torch.randn(t, experts, device="cuda"), -1), topk)
    ids[1, 2] = -1
    kernel = MoEKernel(pf, SwiGLUExperts())

    def step(dbo: bool) -> torch.Tensor:
        def call(lo, hi):
            return kernel(x[lo:hi], w1, w2, weights[lo:hi], ids[lo:hi], global_num_experts=experts)
        if not dbo:
            return call(0, t)
        return torch.cat(run_ubatches([lambda: call(0, t // 2), lambda: call(t // 2, t)]))

    ref = reference_moe(x, w1, w2, weights, stand_in_local_ids(ids, experts, n))
    return step, ref


@pytest.mark.parametrize("layout", ["deepep_ll", "deepep_ht"])
@pytest.mark.parametrize("n", [4, 32])
def test_the_emulated_rank_is_a_real_moe_plain_and_overlapped(layout, n):
    step, ref = _layer(layout, n, 64, SimulatedLink.parse("deepep-ib"))
    plain = step(False)
    assert relative_error(plain, ref) < 2e-2
    assert relative_error(step(True), plain) < 1e-2
    EMULATED.reset()


def test_a_captured_low_latency_step_replays_as_eager():
    step, ref = _layer("deepep_ll", 16, 64, SimulatedLink.parse("deepep-ib"))
    eager = step(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = step(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert relative_error(out, ref) < 2e-2
    EMULATED.reset()


@pytest.mark.parametrize("n,experts,t,k,extra",
                         [(16, 256, 128, 8, 0), (4, 16, 9, 3, 20), (256, 256, 33, 8, 0)])
def test_the_fused_low_latency_kernels_route_as_the_torch_ops(n, experts, t, k, extra):
    from dbo.backends.emulated import kernels as ll_kernels
    from dbo.backends.emulated.buffer import EmulatedBuffer, EmulatedGroup
    from dbo.backends.fp8 import quantize_fp8_blocks

    torch.manual_seed(n)
    # (at least two hosts: some pairs leave the host)
    buf = EmulatedBuffer(EmulatedGroup(n, 1, min(8, n // 2)), low_latency_mode=True, device="cuda")
    n_local, max_tokens, hidden = experts // n, 2 * t + 3, 7168
    cap = n * max_tokens
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(t)]).to("cuda")
    ids[0, 0] = -1
    slot = buf._ll_slot(max_tokens, hidden, experts, True)
    q, scales, rows, rows0, units = ll_kernels.ll_send(x, ids, buf.share_q, slot, n=n, n_local=n_local,
                                                       cap=cap, use_fp8=True, extra=extra)
    all_ids = buf._with_extra(ids, extra)  # the hot rank's extra pairs: its first ones again
    ref_rows, per_key, dest = buf.pair_rows(all_ids, experts, cap)
    assert units.item() == buf.remote_units(all_ids, n_local, dest).item() > 0
    assert torch.equal(slot["count"].long(), per_key.sum(1))
    begin = torch.cumsum(per_key, 1) - per_key
    assert torch.equal(slot["layout_range"], (begin << 32) | per_key)
    assert torch.equal(rows.sort().values, ref_rows.sort().values)
    assert torch.equal(rows // cap, ref_rows // cap)  # each pair in its expert's slab
    ref_q, ref_scales = quantize_fp8_blocks(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    ll_kernels.ll_unpack(q, scales, rows, k, slot)
    tokens = torch.arange(t * k + extra, device="cuda") % (t * k) // k
    valid = all_ids.reshape(-1) >= 0
    assert torch.equal(slot["x"].view(torch.uint8)[rows[valid]], q.view(torch.uint8)[tokens[valid]])
    assert torch.equal(slot["scales"][rows[valid]], scales[tokens[valid]])
    assert torch.equal(slot["src_info"][rows[valid]].long(), tokens[valid])
    assert ll_kernels.ll_remote_units(ids, buf.share_q, n_local, extra).item() == units.item()


@pytest.mark.parametrize("n,experts,t,k,fp8", [(16, 256, 512, 8, True), (4, 16, 9, 3, False)])
def test_the_fused_normal_mode_kernels_receive_and_combine_as_the_torch_ops(n, experts, t, k, fp8):
    from dbo.backends.emulated import kernels

    torch.manual_seed(n)
    dev, hidden, n_local = "cuda", 7168, experts // n
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(t)]).to(dev)
    ids[0, 0] = -1
    w = torch.rand(t, k, device=dev)
    dest = torch.where(ids >= 0, ids // n_local, n)
    in_rank = torch.zeros(t, n + 1, dtype=torch.bool, device=dev)
    in_rank.scatter_(1, dest, True)
    in_rank = in_rank[:, :n].contiguous()
    flat = in_rank.t().reshape(-1)
    pos = torch.cumsum(flat.long(), 0) - 1
    m = int(flat.sum())
    x = torch.randn(t, hidden, device=dev)
    q, scales = (x.to(torch.float8_e4m3fn), torch.rand(t, hidden // 128, device=dev)) if fp8 \
        else (x.to(torch.bfloat16), None)
    recv_q, recv_scales, recv_ids, recv_w, row_src = kernels.ht_receive(q, scales, ids, w, in_rank, pos, m,
                                                                        n_local)
    spare = torch.where(flat, pos, t * n)
    want_src = torch.zeros(t * n + 1, dtype=torch.long, device=dev)
    want_src.index_copy_(0, spare, torch.arange(t, device=dev).repeat(n))
    want_rank = torch.zeros(t * n + 1, dtype=torch.long, device=dev)
    want_rank.index_copy_(0, spare, torch.arange(n, device=dev).repeat_interleave(t))
    want_src, want_rank = want_src[:m], want_rank[:m]
    assert torch.equal(row_src, want_src)
    assert torch.equal(recv_q.view(torch.uint8), q.view(torch.uint8)[want_src])
    if fp8:
        assert torch.equal(recv_scales, scales[want_src])
    rows_ids = ids[want_src]
    mine = (rows_ids // n_local == want_rank[:, None]) & (rows_ids >= 0)
    assert torch.equal(recv_ids, torch.where(mine, rows_ids % n_local, -1))
    assert torch.equal(recv_w, torch.where(mine, w[want_src], 0.0))
    back = torch.randn(m, hidden, device=dev).to(torch.bfloat16)
    acc = torch.zeros(t, hidden, device=dev)
    acc.index_add_(0, want_src, back.float())
    # (float32 sums in another order: equal up to bf16's rounding)
    assert relative_error(kernels.ht_combine(back, in_rank, pos), acc.to(torch.bfloat16)) < 1e-2


@pytest.mark.parametrize("n,gph,n_local,k,t,rank", [(32, 8, 8, 8, 4096, 5), (256, 8, 1, 8, 2051, 255),
                                                    (8, 8, 2, 4, 300, 1), (16, 8, 16, 8, 16384, 0)])
def test_the_normal_mode_layout_kernels_count_as_the_torch_ops(n, gph, n_local, k, t, rank):
    from dbo.backends.emulated import kernels
    from dbo.backends.emulated.buffer import EmulatedBuffer, EmulatedGroup

    torch.manual_seed(t)
    experts = n * n_local
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(t)]).to("cuda")
    ids[torch.rand(t, k, device="cuda") < 0.1] = -1
    buf = EmulatedBuffer(EmulatedGroup(n, rank, gpus_per_host=gph), device="cuda")
    lay = kernels.ht_layout(ids, n=n, n_local=n_local, num_hosts=buf.num_hosts, rank=rank)
    buf._ht_layout = None
    with pytest.MonkeyPatch.context() as mp:  # the torch route
        mp.setattr(kernels, "usable", lambda _t: False)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, experts)
    flat = in_rank.t().reshape(-1)
    local = torch.bincount(torch.remainder(ids[ids >= 0], n_local), minlength=n_local)
    assert torch.equal(lay.in_rank, in_rank)
    assert torch.equal(lay.per_rank, per_rank) and torch.equal(lay.per_expert, per_expert)
    assert (lay.per_host is None) == (per_host is None)
    assert per_host is None or torch.equal(lay.per_host, per_host)
    assert torch.equal(lay.pos, torch.cumsum(flat.to(torch.int64), 0) - 1)
    assert lay.counts.tolist() == [int(flat.sum())] + local.tolist()
    if buf.num_hosts > 1:
        assert torch.equal(lay.units, buf._quantized(buf.rows_off_host(in_rank)))
    assert int(lay.other) == int((in_rank & buf._other_rank).sum())
