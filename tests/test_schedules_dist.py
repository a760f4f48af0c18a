"""The merged expert schedule on multi-rank backends: gloo (naive, all2all; 2 and 4 ranks) and
the fake DeepEP backends (normal mode, STANDARD format; low-latency mode, BATCHED_EXPERTS).

Every case runs plainly and overlapped under the merged schedule and compares both with the
single-process reference and with each other, as tests/test_backends_numerics.py does for the
split schedule; the conformance suite checks the DeepEP backends' hook flow and that exactly one
merged experts call ran per layer.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.distributed as dist

from dbo.backends.all2all import AllToAllPrepareAndFinalize
from dbo.backends.naive import NaivePrepareAndFinalize
from dbo.testing.conformance import check_backend, default_cases, with_options
from dbo.testing.fake_deep_ep import fake_deepep_case_backend
from dbo.testing.moe_cases import MoECase, check_case, standard_cases

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

BACKENDS = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}


def _check_cases(cases: list[MoECase], backend: str, use_async: bool, num_ubatches: int) -> list[tuple]:
    rank = dist.get_rank()
    out = []
    for i, case in enumerate(cases):
        rep = check_case(case, rank, lambda: BACKENDS[backend](timeout_s=20.0, use_async=use_async),
                         num_ubatches=num_ubatches, expert_schedule="merged")
        out.append((i, rep.err_seq, rep.err_dbo, rep.err_dbo_vs_seq, rep.tol, rep.num_tokens))
    return out


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("ws,num_ubatches", [(2, 2), (2, 3), (4, 2)])
def test_merged_matches_plain_on_gloo(worlds, ws, num_ubatches, backend, use_async):
    cases = standard_cases(ws)
    per_rank = worlds(ws).run(_check_cases, cases, backend, use_async, num_ubatches, timeout_s=120)
    bad = []
    for rank, rows in enumerate(per_rank):
        for i, e_seq, e_dbo, e_vs, tol, m in rows:
            if not max(e_seq, e_dbo, e_vs) <= tol or any(math.isnan(v) for v in (e_seq, e_dbo, e_vs)):
                bad.append(f"rank {rank} tokens {m} {cases[i]}: seq {e_seq:.3g} dbo {e_dbo:.3g} "
                           f"dbo-vs-seq {e_vs:.3g} > {tol}")
    assert not bad, "\n".join(bad)


def _merged(cases):
    return [dataclasses.replace(c, name=f"{c.name} merged", expert_schedule="merged") for c in cases]


def test_merged_on_fake_deepep_ht(worlds):
    cases = _merged([with_options(c, backend="ht") for c in default_cases(2)])
    base = default_cases(2)[1]
    cases += _merged([with_options(dataclasses.replace(base, name="fp8", tol_ref=6e-2),
                                   backend="ht", use_fp8_dispatch=True)])
    check_backend(worlds(2), fake_deepep_case_backend, cases)


def test_merged_on_fake_deepep_ll(worlds):
    # two ubatches at most on deepep_ll (two receive buffers), experts never reduce
    cases = [with_options(c, backend="ll") for c in default_cases(2)
             if c.num_ubatches == 2 and c.reduce_in_experts]
    base = default_cases(2)[1]
    cases += [with_options(dataclasses.replace(base, name="fp8 kept", hidden=2048, tol_ref=6e-2),
                           backend="ll", use_fp8_dispatch=True, dequantize_received=False)]
    results = check_backend(worlds(2), fake_deepep_case_backend, _merged(cases))
    assert all(r.hooks_registered == 4 == r.hooks_run for r in results)


def _plan_job(schedules: list[str]) -> str:
    from dbo.split import SplitConfig, plan_ubatches

    cfg = SplitConfig(expert_schedule=schedules[dist.get_rank()], decode_token_threshold=1,
                      prefill_token_threshold=1)
    try:
        plan = plan_ubatches(16, cfg)
    except ValueError as exc:
        return f"error: {exc}"
    return plan.expert_schedule.value


def test_ranks_must_agree_on_the_schedule(worlds):
    # the merged schedule issues the combines in another order: a mix would pair the wrong
    # collectives, so the vote refuses it on every rank
    out = worlds(2).run(_plan_job, ["merged", "split"], timeout_s=60)
    assert all(o.startswith("error:") and "expert_schedule" in o for o in out), out
    assert worlds(2).run(_plan_job, ["merged", "merged"], timeout_s=60) == ["merged", "merged"]
