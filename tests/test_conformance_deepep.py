"""The backend conformance suite on the DeepEP backends, against the fake ``deep_ep`` on gloo.

DBO == serial == reference, per-ubatch handles (forced interleaving), hook flow, zero-token
ranks and ubatches, for deepep_ht (bf16, fp8, padded hidden, sync finish), deepep_ll (bf16,
fp8, padded hidden) and deepep_v2 (decode and prefill, ElasticBuffer and EPBuffer APIs).
"""

from __future__ import annotations

import dataclasses

import pytest

from dbo.testing.conformance import check_backend, default_cases, with_options
from dbo.testing.fake_deep_ep import fake_deepep_case_backend

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _cases(**options):
    return [with_options(c, **options) for c in default_cases(2)]


def test_deepep_ht_conformance(world2):
    cases = _cases(backend="ht")
    base = default_cases(2)[1]
    cases += [
        with_options(dataclasses.replace(base, name="padded hidden 200", hidden=200), backend="ht"),
        with_options(dataclasses.replace(base, name="fp8", tol_ref=6e-2), backend="ht",
                     use_fp8_dispatch=True),
        with_options(dataclasses.replace(base, name="fp8 padded hidden 320", hidden=320, tol_ref=6e-2),
                     backend="ht", use_fp8_dispatch=True),
        with_options(dataclasses.replace(base, name="sync finish"), backend="ht", async_finish=False),
    ]
    results = check_backend(world2, fake_deepep_case_backend, cases)
    assert all(r.yields > 0 for r in results)  # dispatch and combine yield before launching


def test_deepep_ll_conformance(world2):
    # batched format: the experts never reduce; two ubatches at most (see the limit test)
    cases = [c for c in _cases(backend="ll") if c.num_ubatches == 2 and c.reduce_in_experts]
    base = default_cases(2)[1]
    cases += [
        with_options(dataclasses.replace(base, name="fp8", hidden=512, tol_ref=6e-2),
                     backend="ll", use_fp8_dispatch=True),
        with_options(dataclasses.replace(base, name="hidden 2048 unpadded", hidden=2048),
                     backend="ll"),
        # fp8 handed to the experts with the scales of the unpadded hidden's blocks only
        with_options(dataclasses.replace(base, name="fp8 padded hidden 200, experts dequantize",
                                         hidden=200, tol_ref=6e-2),
                     backend="ll", use_fp8_dispatch=True, dequantize_received=False),
    ]
    results = check_backend(world2, fake_deepep_case_backend, cases)
    # two ubatches, each registers a dispatch and a combine hook: all ran
    assert all(r.hooks_registered == 4 == r.hooks_run for r in results)


@pytest.mark.parametrize("api", ["v2-elastic", "v2-ep"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_deepep_v2_conformance(world2, api, mode):
    cases = _cases(backend="v2", api=api, mode=mode)
    if mode == "prefill":
        base = default_cases(2)[2]
        cases.append(with_options(dataclasses.replace(base, name="expert_alignment 4"), backend="v2",
                                  api=api, mode=mode, expert_alignment=4))
    check_backend(world2, fake_deepep_case_backend, cases)
