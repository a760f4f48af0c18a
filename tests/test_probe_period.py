"""tools/probes/period_model.py and its CLI tools/probes/dbo_period.py: the model of an MoE
layer's overlap schedules, against cases worked by hand and properties every schedule keeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

_PROBES = Path(__file__).resolve().parents[1] / "tools" / "probes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


period_model = _load("period_model")
dbo_period = _load("dbo_period")
Parts, simulate = period_model.Parts, period_model.simulate
SCHEDULES = tuple(period_model.SCHEDULES)
TWO_UBATCH = tuple(n for n, s in period_model.SCHEDULES.items() if s.ubatches == 2)


def _link_only(comm: float) -> Parts:
    return Parts(attn=0.0, experts=0.0, dispatch=comm / 2, combine=comm / 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_resource_alone_sets_the_period(schedule):
    # nothing to overlap: the busy resource's whole time (split adds its factor to the compute)
    split = 1.5 if period_model.SCHEDULES[schedule].ubatches == 2 else 1.0
    parts = Parts(attn=2.0, experts=8.0, shared=1.0, dispatch=0.0, combine=0.0, split=1.5)
    assert simulate(schedule, parts) == pytest.approx(11.0 * split)
    assert simulate(schedule, _link_only(10.0)) == pytest.approx(10.0)


def test_serial_is_compute_plus_comm():
    parts = Parts(attn=1.0, experts=2.0, shared=1.0, dispatch=3.0, combine=4.0, latency=0.5,
                  split=2.0, combine_bytes=3.0)
    assert simulate("serial", parts) == pytest.approx(11.0)


def test_plain_hides_the_shared_expert_behind_the_combine():
    # attention 1, dispatch 2, experts 4, then the shared expert (1) beside the combine (2)
    parts = Parts(attn=1.0, experts=4.0, shared=1.0, dispatch=2.0, combine=2.0)
    assert simulate("plain", parts) == pytest.approx(9.0)
    assert simulate("serial", parts) == pytest.approx(10.0)


def test_dbo_order_exposes_half_the_link_when_experts_dominate_the_compute():
    # worked by hand: per layer the experts (27 ms) and two of the four transfers (2 x 23.05 / 4)
    # run in turn, because A's next dispatch waits behind B's experts (its attention) and
    # behind B's combine (the link's queue)
    parts = Parts(attn=1.0, experts=27.0, dispatch=23.05 / 2, combine=23.05 / 2)
    period = simulate("dbo", parts)
    assert period == pytest.approx(27.0 + 23.05 / 2, rel=1e-3)
    # neither fix alone moves it; both together reach the bound (the compute, 28 ms)
    assert simulate("dbo-2comm", parts) == pytest.approx(period, rel=1e-3)
    assert simulate("dbo-attn-2comm", parts) == pytest.approx(28.0, rel=1e-3)


def test_dbo_variants_by_hand():
    # per ubatch: experts 2, shared expert 1 (beside its combine), dispatch 2, combine 0.5, no
    # attention. dbo: compute eA [0,2] shA [2,3] eB [3,5] shB [5,6]; A's next attention waits
    # behind shB (6), its dispatch [6,8], eA' at 8: the compute (6) plus A's whole dispatch
    parts = Parts(attn=0.0, experts=4.0, shared=2.0, dispatch=4.0, combine=1.0)
    assert simulate("dbo", parts) == pytest.approx(8.0)
    # a comm stream per ubatch alone: A's dispatch still waits for its attention (6): 8
    assert simulate("dbo-2comm", parts) == pytest.approx(8.0)
    # the attention on its own stream alone: it runs at 3, but A's dispatch is queued behind B's
    # combine (ready at 5, [5,5.5]): dispatch [5.5,7.5], eA' at 7.5
    assert simulate("dbo-attn", parts) == pytest.approx(7.5)
    # both: A's dispatch [3,5] leaves before B's combine [5,5.5]; eA' at 6: the compute bound
    assert simulate("dbo-attn-2comm", parts) == pytest.approx(6.0)


def test_attention_on_its_own_stream_takes_its_sms_from_the_experts():
    # per ubatch: attention 1, experts 4, dispatch 1, combine 2. dbo: eA [0,4] eB [4,8] aA' [8,9]
    # aB' waits for cB [8,10]: [10,11]; A's dispatch behind cB: [10,11]; eA' at 11
    parts = Parts(attn=2.0, experts=8.0, dispatch=2.0, combine=4.0)
    assert simulate("dbo", parts) == pytest.approx(11.0)
    # on its own stream A's attention starts at cA's end (6) and pauses eB: eB ends at 9, cB
    # [9,11], A's dispatch behind it [11,12], eA' at 12: the priority costs 1 here
    assert simulate("dbo-attn", parts) == pytest.approx(12.0)


def test_sbo_by_hand():
    # attention [0,1]; dispatch [1,3] with the shared expert [1,2] beside it; experts in two
    # groups [3,5] [5,7]; their combines [5,6] [7,8]; the next attention at 8
    parts = Parts(attn=1.0, experts=4.0, shared=1.0, dispatch=2.0, combine=2.0)
    assert simulate("sbo", parts, groups=2) == pytest.approx(8.0)
    # one group: the shared expert beside the dispatch is all it hides: 1 + 2 + 4 + 2
    assert simulate("sbo", parts, groups=1) == pytest.approx(9.0)
    # partial sums: each group's combine carries 1.5x half the bytes, the last [7,8.5]
    more_bytes = Parts(attn=1.0, experts=4.0, shared=1.0, dispatch=2.0, combine=2.0,
                       combine_bytes=1.5)
    assert simulate("sbo", more_bytes, groups=2) == pytest.approx(8.5)
    # a 0.5 latency in each transfer: a group's combine is 0.5 + 1.5 / 2, the last [7,8.25]
    latency = Parts(attn=1.0, experts=4.0, shared=1.0, dispatch=2.0, combine=2.0, latency=0.5)
    assert simulate("sbo", latency, groups=2) == pytest.approx(8.25)


def test_sbo_dbo_by_hand():
    # per ubatch: two expert groups of 1, dispatch 1, combine groups of 0.5, no attention.
    # compute xA1 [0,1] xA2 [1,2] xB1 [2,3] xB2 [3,4]; link cA1 cA2 cB1 [3,3.5] cB2 [4,4.5];
    # A's next dispatch behind cB2: [4.5,5.5], xA1' at 5.5: the compute plus 1.5
    parts = Parts(attn=0.0, experts=4.0, dispatch=2.0, combine=2.0)
    assert simulate("sbo+dbo", parts, groups=2) == pytest.approx(5.5)
    assert simulate("dbo", parts) == pytest.approx(6.0)


def test_partial_sum_bytes_factor():
    f = period_model.partial_sum_bytes_factor
    assert f(1, 128, 256, 8) == pytest.approx(1.0)
    # top-1: a token hits one expert, so one group: no extra rows
    assert f(4, 8, 64, 1) == pytest.approx(1.0)
    # top-2 of 4 experts, all local, two groups of 2: a group is missed with probability
    # C(2,2)/C(4,2) = 1/6, so 2 x 5/6 rows per token
    assert f(2, 4, 4, 2) == pytest.approx(5 / 3)
    # 2 ranks of 256 experts, top-8, two groups of 64: about 1.81
    assert f(2, 128, 256, 8) == pytest.approx(1.8134, abs=1e-3)
    with pytest.raises(ValueError, match="groups=3"):
        f(3, 128, 256, 8)


_times = st.floats(0.0, 10.0, allow_nan=False)


@given(attn=_times, experts=_times, shared=_times, dispatch=_times, combine=_times,
       split=st.floats(1.0, 2.5), combine_bytes=st.floats(1.0, 3.0),
       schedule=st.sampled_from(SCHEDULES), groups=st.integers(1, 4))
def test_no_schedule_beats_the_bound_and_serial_adds(attn, experts, shared, dispatch, combine,
                                                    split, combine_bytes, schedule, groups):
    parts = Parts(attn=attn, experts=experts, shared=shared, dispatch=dispatch, combine=combine,
                  split=split, combine_bytes=combine_bytes)
    period = simulate(schedule, parts, layers=16, groups=groups)
    assert period >= max(parts.compute, parts.comm) - 1e-9
    # and no worse than its own ops in turn (some resource is always busy): each ubatch's
    # compute carries the split, each grouped combine its bytes
    s = period_model.SCHEDULES[schedule]
    compute = parts.compute * (split if s.ubatches == 2 else 1.0)
    comm = parts.dispatch + parts.combine * (combine_bytes if s.grouped and groups > 1 else 1.0)
    assert period <= compute + comm + 1e-9
    assert simulate("serial", parts, layers=16) == pytest.approx(parts.compute + parts.comm)


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        simulate("nope", _link_only(1.0))
    with pytest.raises(ValueError, match="layers"):
        simulate("dbo", _link_only(1.0), layers=4)
    with pytest.raises(ValueError, match="latency"):
        Parts(attn=1.0, experts=1.0, dispatch=0.1, combine=1.0, latency=0.5)
    with pytest.raises(ValueError, match="split"):
        Parts(attn=1.0, experts=1.0, dispatch=1.0, combine=1.0, split=0.5)
    with pytest.raises(ValueError, match="attn"):
        Parts(attn=-1.0, experts=1.0, dispatch=1.0, combine=1.0)


def test_cli(capsys):
    assert dbo_period.main(["--experts-ms", "27", "--attn-ms", "1", "--link-ms", "23.05"]) == 0
    out = capsys.readouterr().out
    assert "           dbo:   38.5" in out, out  # 27 + 23.05 / 2
    assert dbo_period.main(["--table"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 2 + len(dbo_period.CASES), out
    # the comm-bound prefill: dbo at the bound, the plain forward hides only its shared expert
    assert "| prefill 50 GB/s T=16384 I=256 | 5.94 | 10.42 | 1.57x | 1.02x | 1.57x |" in out, out
    with pytest.raises(SystemExit) as exit_info:
        dbo_period.main(["--experts-ms", "1"])
    assert exit_info.value.code == 2
