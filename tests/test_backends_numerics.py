"""naive and all2all backends on gloo, 2 and 4 ranks: plain and overlapped vs the reference MoE.

Every case runs the MoE step plainly and as two DBO ubatches on every rank and compares both
with the single-process reference and with each other (fp32 <= 1e-5, bf16 <= 2e-2 relative).
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from hypothesis import given, note, settings
from hypothesis import strategies as st

from dbo.backends.all2all import AllToAllPrepareAndFinalize
from dbo.backends.naive import NaivePrepareAndFinalize
from dbo.testing.moe_cases import MoECase, check_case, standard_cases

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

BACKENDS = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}


def _check_cases(cases: list[MoECase], backend: str, use_async: bool) -> list[tuple]:
    """Runs on every rank: (case index, err_seq, err_dbo, err_dbo_vs_seq, tol, tokens)."""
    rank = dist.get_rank()
    out = []
    for i, case in enumerate(cases):
        rep = check_case(case, rank, lambda: BACKENDS[backend](timeout_s=20.0, use_async=use_async))
        out.append((i, rep.err_seq, rep.err_dbo, rep.err_dbo_vs_seq, rep.tol, rep.num_tokens))
    return out


def _assert_all_match(cases: list[MoECase], per_rank: list[list[tuple]]) -> None:
    bad = []
    for rank, rows in enumerate(per_rank):
        for i, e_seq, e_dbo, e_vs, tol, m in rows:
            if not max(e_seq, e_dbo, e_vs) <= tol or any(math.isnan(v) for v in (e_seq, e_dbo, e_vs)):
                bad.append(f"rank {rank} tokens {m} {cases[i]}: seq {e_seq:.3g} dbo {e_dbo:.3g} "
                           f"dbo-vs-seq {e_vs:.3g} > {tol}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("ws", [2, 4])
def test_backend_matches_reference(worlds, ws, backend, use_async):
    cases = standard_cases(ws)
    _assert_all_match(cases, worlds(ws).run(_check_cases, cases, backend, use_async, timeout_s=90))


@st.composite
def _random_cases(draw, ws: int) -> list[MoECase]:
    cases = []
    for _ in range(draw(st.integers(1, 3))):
        e = ws * draw(st.sampled_from([1, 2, 4]))
        routing = draw(st.sampled_from(["random", "padding", f"avoid_rank:{draw(st.integers(0, ws - 1))}"]))
        if routing.startswith("avoid_rank") and e == ws:
            routing = "random"
        max_topk = e - e // ws if routing.startswith("avoid_rank") else e
        cases.append(MoECase(
            seed=draw(st.integers(0, 2**20)),
            tokens_per_rank=tuple(draw(st.lists(st.integers(0, 12), min_size=ws, max_size=ws))),
            num_experts=e,
            topk=draw(st.integers(1, min(8, max_topk))),
            hidden=draw(st.sampled_from([8, 24])),
            dtype=draw(st.sampled_from(["float32", "bfloat16"])),
            routing=routing,
            reduce_in_experts=draw(st.booleans()),
        ))
    return cases


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_backend_random_cases(worlds, data):
    ws = 2
    cases = data.draw(_random_cases(ws), label="cases")
    backend = data.draw(st.sampled_from(sorted(BACKENDS)), label="backend")
    use_async = data.draw(st.booleans(), label="use_async")
    note(f"{backend} async={use_async}")
    _assert_all_match(cases, worlds(ws).run(_check_cases, cases, backend, use_async, timeout_s=60))
