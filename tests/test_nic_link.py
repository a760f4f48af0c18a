"""The NIC-like link: flows served when ready, sharing the rate, each paying its fixed cost; the
presets and their fit to DeepEP's published figures."""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from dbo.backends.simulated_link import SimulatedLink
from dbo.backends.simulated_link.nic import Flow, NicHost, serve
from dbo.backends.simulated_link.presets import DEEPEP_LL_TABLE, PRESETS, fit_deepep_ll, fit_report

GBPS = 50.0  # 5e4 bytes per us


def test_a_flow_ready_first_is_served_first_whatever_the_host_order():
    # the host queues A before B, but B's data is ready first: B goes first, at the full rate
    a, b = Flow(ready_us=100.0, nbytes=50e3), Flow(ready_us=0.0, nbytes=50e3)
    done_a, done_b = serve([a, b], GBPS)
    assert done_b == pytest.approx(1.0)
    assert done_a == pytest.approx(101.0)


def test_two_flows_in_flight_share_the_rate():
    # two flows of 1 us each at the full rate, ready together: both end at 2 us, not 1 and 2
    done = serve([Flow(0.0, 50e3), Flow(0.0, 50e3)], GBPS)
    assert done == pytest.approx([2.0, 2.0])
    # one joins halfway through the other: the first has 0.5 us of bytes left at half the rate
    done = serve([Flow(0.0, 50e3), Flow(0.5, 50e3)], GBPS)
    assert done == pytest.approx([1.5, 2.0])


def test_the_fixed_cost_is_a_latency_paid_at_once():
    # two flows of no bytes ready together each pay their fixed cost, not one after the other
    assert serve([Flow(0.0, 0.0, 40.0), Flow(0.0, 0.0, 40.0)], GBPS) == [40.0, 40.0]
    # bytes first, then the fixed cost
    assert serve([Flow(10.0, 100e3, 30.0)], GBPS) == pytest.approx([10.0 + 2.0 + 30.0])


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 1e6), st.floats(0, 50)), min_size=1, max_size=8))
def test_the_link_is_work_conserving_and_never_faster_than_alone(spec):
    flows = [Flow(r, b, f) for r, b, f in spec]
    note(f"flows: {flows}")
    done = serve(flows, GBPS)
    rate = GBPS * 1e3
    for f, d in zip(flows, done, strict=True):
        # no flow beats the full rate, none ends before it is ready
        assert d >= f.ready_us + f.nbytes / rate + f.fixed_us - 1e-6
    # flows all ready at once: the last bytes leave when all bytes have left at the full rate
    together = [Flow(0.0, f.nbytes) for f in flows]
    busy = sum(f.nbytes for f in flows) / rate
    assert max(serve(together, GBPS)) == pytest.approx(busy, rel=1e-9, abs=1e-9)


def test_the_host_stand_in_counts_the_flows_registered_before():
    nic = NicHost()
    first = nic.arrival(50e3, 0.0, GBPS, ready_us=0.0)
    assert first == pytest.approx(1.0)
    second = nic.arrival(50e3, 0.0, GBPS, ready_us=0.5)  # shares the rate with the first
    assert second == pytest.approx(2.0)


def test_links_parse_presets_and_keep_the_numeric_form():
    link = SimulatedLink.parse("deepep-ib", 0.875)
    gbps, dispatch_us, combine_us = PRESETS["deepep-ib"]
    assert (link.gbps, link.fixed_us("dispatch"), link.fixed_us("combine")) == (gbps, dispatch_us, combine_us)
    assert link.name == "deepep-ib" and link.order == "nic" and link.remote_fraction == 0.875
    assert SimulatedLink.parse("25,10,20").fixed_us("combine_group") == 20.0
    assert SimulatedLink.parse("25,10").fixed_us("combine") == 10.0
    assert SimulatedLink.parse("25,10", order="host").order == "host"
    with pytest.raises(ValueError, match="order"):
        SimulatedLink(25, order="fifo")
    assert "deepep-ib" in link.describe() and "NIC" in link.describe()


def test_the_preset_fits_deepeps_low_latency_table_within_ten_percent():
    fit = fit_deepep_ll()
    assert set(fit.rows) == set(DEEPEP_LL_TABLE)
    assert fit.worst_residual < 0.10
    assert 30 < fit.gbps < 60 and 0 < fit.dispatch_fixed_us < 60 and 0 < fit.combine_fixed_us < 60
    report = fit_report(fit)
    assert all(f"{ep:>3}" in report for ep in DEEPEP_LL_TABLE)
