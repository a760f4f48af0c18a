"""tools/probes/dbo_period.py: the model of two ubatches taking turns on the compute stream and
one link, against cases worked by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "dbo_period", Path(__file__).resolve().parents[1] / "tools" / "probes" / "dbo_period.py")
dbo_period = importlib.util.module_from_spec(_SPEC)
sys.modules["dbo_period"] = dbo_period  # its dataclasses look their module up
_SPEC.loader.exec_module(dbo_period)
simulate = dbo_period.simulate


@pytest.mark.parametrize("order", dbo_period.ORDERS)
@pytest.mark.parametrize("link_order", dbo_period.LINK_ORDERS)
def test_one_resource_alone_sets_the_period(order, link_order):
    # nothing to overlap: the period is the busy resource's whole time (the attention on a
    # stream of its own runs beside the experts for free: that order's best case)
    compute = 8.0 if order == "attn-stream" else 10.0
    assert simulate(order, 40, 2.0, 8.0, 0.0, link_order) == pytest.approx(compute)
    assert simulate(order, 40, 0.0, 0.0, 10.0, link_order) == pytest.approx(10.0)


def test_dbo_order_exposes_half_the_link_when_experts_dominate_the_compute():
    # worked by hand: per layer the experts (27 ms) and two of the four transfers (2 x 23.05 / 4)
    # run in turn, because A's next dispatch waits behind B's experts (its attention) and
    # behind B's combine (the link's queue)
    period = simulate("dbo", 40, 1.0, 27.0, 23.05, "fifo")
    assert period == pytest.approx(27.0 + 23.05 / 2, rel=1e-3)
    # neither fix alone moves it; both together reach the bound (the experts, 27 ms)
    assert simulate("attn-stream", 40, 1.0, 27.0, 23.05, "fifo") == pytest.approx(period, rel=1e-3)
    assert simulate("dbo", 40, 1.0, 27.0, 23.05, "ready") == pytest.approx(period, rel=1e-3)
    assert simulate("attn-stream", 40, 1.0, 27.0, 23.05, "ready") == pytest.approx(27.0, rel=1e-3)


def test_comm_bound_layers_are_hidden():
    # the link dominates (I=256 under 50 GB/s): DBO's step is the link's time, as measured
    for order in ("dbo", "attn-stream"):
        assert simulate(order, 40, 1.3, 5.0, 25.6) == pytest.approx(25.6)
    # queuing A's next attention between B's expert halves exposes it there
    assert simulate("chunked2", 40, 1.3, 5.0, 25.6) == pytest.approx(25.6 + 1.3)


def test_bad_arguments(capsys):
    with pytest.raises(ValueError, match="order"):
        simulate("nope", 40, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="link_order"):
        simulate("dbo", 40, 1.0, 1.0, 1.0, "nope")
    assert dbo_period.main(["--experts-ms", "27", "--attn-ms", "1", "--link-ms", "23.05"]) == 0
    out = capsys.readouterr().out
    assert "dbo, link  fifo:   38.53 ms per layer" in out, out
