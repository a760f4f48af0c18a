"""``python -m dbo.bench experts``'s harness on the CPU: cases shaped as a backend delivers them,
every implementation timed, and the library's two paths (host counts, device offsets) giving the
same output as the reference."""

from __future__ import annotations

import pytest
import torch

from dbo.bench.experts.command import (
    add_limits,
    apply_experts,
    format_rows,
    limit_summary,
    make_case,
    run_grid,
    time_experts,
)
from dbo.bench.limits import DeviceLimits, active_experts, experts_cost, measure_device_limits
from dbo.experts import SwiGLUExperts, reference_moe, relative_error
from dbo.moe import Workspace


def test_case_is_what_a_rank_receives():
    case = make_case(64, 32, 16, 4, num_experts=16, topk=3, dtype=torch.float32, device="cpu")
    assert case.x.shape == (64, 32) and case.w1.shape == (4, 32, 32) and case.w2.shape == (4, 32, 16)
    assert case.ids.shape == (64, 3) and bool(((case.ids >= -1) & (case.ids < 4)).all())
    assert int(case.counts.sum()) == int((case.ids >= 0).sum())
    assert (case.ids == -1).any()  # slots of the other ranks' experts


def test_grid_times_every_implementation_and_outputs_agree():
    impls = {"host": (SwiGLUExperts(use_triton=False), True),
             "device": (SwiGLUExperts(use_triton=False), False)}
    rows = run_grid(impls, hidden=[32], intermediate=[16], tokens=[8, 40], local_experts=[4, 2],
                    topk=3, steps=3, num_experts=8, dtype=torch.float32, device="cpu")
    assert [(r.local_experts, r.tokens) for r in rows] == [(4, 8), (4, 40), (2, 8), (2, 40)]
    for r in rows:
        assert set(r.results) == {"host", "device"}
        assert all(v.median_ms > 0 for v in r.results.values())
        assert r.results["device"].rel_err < 1e-6
        assert r.limit_ms is None and r.ranks is None  # no limits yet; standard rows have no ranks
    table = format_rows(rows, "host").splitlines()
    assert len(table) == 1 + len(rows) + 1 and "device/host" in table[0]
    assert table[-1].startswith("  hidden, I: ") and "A/B: A's time / host's" in table[-1]  # the columns
    case = make_case(40, 32, 16, 2, num_experts=8, topk=3, dtype=torch.float32, device="cpu", seed=40)
    out = apply_experts(SwiGLUExperts(use_triton=False), case, False, Workspace())
    assert relative_error(out, reference_moe(case.x, case.w1, case.w2, case.weights, case.ids)) < 1e-5


def test_limits_are_measured_and_every_row_gets_its_ratio():
    limits = measure_device_limits("cpu", copy_bytes=1 << 20, gemm_n=64, reps=3)
    assert limits.copy_gbps > 0 and limits.gemm_tflops > 0
    assert limits.instance is None and limits.as_dict()["instance"] is None  # a GPU's UUID only
    impls = {"a": (SwiGLUExperts(use_triton=False), False)}
    rows = run_grid(impls, hidden=[32], intermediate=[16], tokens=[8, 40], local_experts=[4],
                    topk=3, steps=2, num_experts=8, dtype=torch.float32, device="cpu")
    rows = add_limits(rows, limits, dtype_bytes=4)
    for r in rows:
        res = r.results["a"]
        assert r.limit_ms > 0 and res.x_limit == res.median_ms / r.limit_ms
        assert r.limit_bound in ("flops", "bytes")
    summary = limit_summary(rows)["a"]
    assert summary["worst_x_limit"] >= summary["geomean_x_limit"] > 0
    table = format_rows(rows, "a")
    assert "x lim" in table and "geometric mean" in table


def test_the_limit_formula():
    lim = DeviceLimits("test", copy_gbps=1000.0, gemm_tflops=100.0)  # 1 TB/s, 100 TFLOP/s
    flops, nbytes = experts_cost(hidden=100, intermediate=50, local_pairs=20, experts_with_rows=3,
                                 dtype_bytes=2)
    assert flops == 6 * 20 * 100 * 50
    # weights read + per pair: [H] in and [2I] out (gate/up), [I] in and [H] out (down)
    assert nbytes == 3 * 3 * 100 * 50 * 2 + 20 * ((100 + 2 * 50) + (50 + 100)) * 2
    assert lim.time_ms(flops, nbytes) == max(nbytes / 1e12, flops / 1e14) * 1e3
    assert lim.time_ms(1e14, 0) == 1000.0 and lim.time_ms(0, 1e12) == 1000.0
    assert active_experts(8, 0) == 0 and 7.9 < active_experts(8, 1000) <= 8
    with pytest.raises(ValueError, match="held"):
        lim.time_ms(flops, nbytes, held=True)
    # the held GEMM rate (a power cap's) moves only the flops-bound limits
    held = DeviceLimits("test", copy_gbps=1000.0, gemm_tflops=100.0, held_gemm_tflops=80.0)
    assert held.time_ms(1e14, 0, held=True) == 1250.0 and held.time_ms(0, 1e12, held=True) == 1000.0
    assert "held for seconds: 80 TFLOP/s" in held.describe() and "held" not in lim.describe()
    named = DeviceLimits("H200", copy_gbps=1000.0, gemm_tflops=100.0, instance="GPU-0-1-2-3-4")
    assert "on H200 (GPU-0-1-2-3-4)" in named.describe() and "GPU-" not in lim.describe()
    # a CPU's rates in the unit that fits: 0.05 TFLOP/s is 50 GFLOP/s, never "0 TFLOP/s"
    cpu = DeviceLimits("cpu", copy_gbps=14.5, gemm_tflops=0.0496)
    assert "max(bytes / 14.5 GB/s, flops / 49.6 GFLOP/s)" in cpu.describe()
    assert "max(bytes / 1 TB/s, flops / 100 TFLOP/s)" in lim.describe()


def test_rate_text_picks_the_prefix_and_three_figures():
    from dbo.bench.limits import rate_text

    cases = [(4.25e12, "4.25 TB/s"), (795e12, "795 TB/s"), (3.1e10, "31 GB/s"), (5.5e8, "550 MB/s"),
             (999.7e9, "1 TB/s"), (1.5e15, "1500 TB/s"), (12.34e3, "12.3 kB/s"), (0.5, "0.5 B/s"),
             (0.0, "0 B/s")]
    assert [rate_text(v, "B/s") for v, _ in cases] == [want for _, want in cases]


def test_rows_get_their_ratio_to_the_held_limit_where_it_was_measured():
    impls = {"a": (SwiGLUExperts(use_triton=False), False)}
    rows = run_grid(impls, hidden=[32], intermediate=[16], tokens=[8, 40], local_experts=[4],
                    topk=3, steps=2, num_experts=8, dtype=torch.float32, device="cpu")
    # a GEMM rate so low that every row is flops-bound: the held ratio is the burst one x 2
    rows = add_limits(rows, DeviceLimits("t", copy_gbps=1e6, gemm_tflops=1e-6, held_gemm_tflops=5e-7),
                      dtype_bytes=4)
    for r in rows:
        res = r.results["a"]
        assert res.x_held == pytest.approx(res.x_limit / 2)
    s = limit_summary(rows)["a"]
    assert s["geomean_x_held"] == pytest.approx(s["geomean_x_limit"] / 2)
    assert "at the held GEMM rate" in format_rows(rows, "a")
    rows = add_limits(rows, DeviceLimits("t", copy_gbps=1e6, gemm_tflops=1e-6), dtype_bytes=4)
    assert "geomean_x_held" not in limit_summary(rows)["a"]
    assert all(r.held_limit_ms is None and r.results["a"].x_held is None for r in rows)


def test_timings_are_checked_and_each_call_reports_its_host_time():
    impls = {"a": (SwiGLUExperts(use_triton=False), False)}
    case = make_case(16, 32, 16, 4, num_experts=8, topk=3, dtype=torch.float32, device="cpu")
    for bad in ((), ("gpu",), ("device", "wall")):
        with pytest.raises(ValueError, match="timings"):
            time_experts(impls, case, steps=2, timings=bad)
    res = time_experts(impls, case, steps=3, timings=("device", "idle"))
    # on the CPU there is no queue to get ahead of: one wall-time measure per implementation
    assert set(res) == {"a"} and res["a"]["host_ms"] > 0 and res["a"]["median_ms"] > 0
    assert res["a"]["rel_err"] == 0.0


def test_experts_call_is_one_library_call_on_the_case():
    from dbo.bench.experts.command import experts_call
    from dbo.experts import SwiGLUExperts, reference_moe, relative_error

    case = make_case(24, 32, 16, 4, num_experts=8, topk=3, dtype=torch.float32, device="cpu", seed=3)
    experts = SwiGLUExperts()
    out = experts_call(case, experts, num_experts=8)()
    assert experts.num_global_experts == 8
    ref = reference_moe(case.x, case.w1, case.w2, case.weights, case.ids)
    assert relative_error(out, ref) < 1e-5


def test_a_batched_case_is_what_a_low_latency_backend_delivers():
    from dbo.bench.experts.command import make_batched_case

    case = make_batched_case(12, 32, 16, 4, ranks=2, topk=3, dtype=torch.float32, device="cpu")
    assert case.x.shape == (4, 24, 32) and case.counts.shape == (4,) and case.ids.shape == (12, 3)
    assert int(case.counts.sum()) <= 24 * 3 and bool((case.counts <= 24).all())
    for e, c in enumerate(case.counts_cpu.tolist()):  # the rows past each count are zeros
        assert bool((case.x[e, c:] == 0).all()) and (c == 0 or bool(case.x[e, :c].abs().sum() > 0))
    assert bool(((case.ids >= -1) & (case.ids < 4)).all()) and (case.ids == -1).any()
    with pytest.raises(ValueError, match="topk"):
        make_batched_case(4, 32, 16, 1, ranks=2, topk=3, dtype=torch.float32, device="cpu")


def test_the_batched_grid_compares_the_rows_that_arrived():
    from dbo.bench.experts.command import make_batched_case
    from dbo.experts.swiglu import swiglu_expert

    impls = {"a": (SwiGLUExperts(use_triton=False), False), "b": (SwiGLUExperts(use_triton=False), True)}
    rows = run_grid(impls, hidden=[32], intermediate=[16], tokens=[4, 12], local_experts=[4], topk=3,
                    steps=2, dtype=torch.float32, device="cpu", layout="batched", ranks=2)
    shapes = [(r.layout, r.tokens, r.ranks, r.capacity) for r in rows]
    assert shapes == [("batched", 4, 2, 8), ("batched", 12, 2, 24)]
    assert all(r.results["b"].rel_err < 1e-6 for r in rows)
    case = make_batched_case(12, 32, 16, 4, ranks=2, topk=3, dtype=torch.float32, device="cpu", seed=12)
    got = case.arrived(apply_experts(SwiGLUExperts(use_triton=False), case, False, Workspace()))
    want = torch.cat([swiglu_expert(case.x[e, :c], case.w1[e], case.w2[e])
                      for e, c in enumerate(case.counts_cpu.tolist())])
    assert got.shape == (int(case.counts.sum()), 32) and relative_error(got, want) < 1e-5
    with pytest.raises(ValueError, match="layout"):
        run_grid(impls, hidden=[32], intermediate=[16], tokens=[4], local_experts=[4], layout="packed")


@pytest.mark.parametrize("changes, message", [
    (dict(tokens=(8, 0)), "--tokens must be positive, got [8, 0]"),
    (dict(steps=0), "--ranks, --steps and --topk must be positive"),
    (dict(layout="batched", topk=9), "--topk 9 is more than the 8 experts of --local-experts 4 x --ranks 2"),
    (dict(layout="packed"), "--layout packed"),
    (dict(timing=("device", "warm")), "--timing device warm"),
    (dict(held_s=-1.0), "--held-s -1.0"),
])
def test_the_options_refuse_what_no_run_can_honour(changes, message):
    from dbo.bench.experts.options import ExpertsOptions

    base = dict(intermediate=(16,), tokens=(8,), local_experts=(4,), topk=3)
    assert ExpertsOptions(**base).timing == ("device", "idle")
    with pytest.raises(ValueError) as exc:
        ExpertsOptions(**{**base, **changes})
    assert message in str(exc.value) and "\n" not in str(exc.value)
