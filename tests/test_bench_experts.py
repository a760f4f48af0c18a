"""``python -m dbo.bench experts``'s harness on the CPU: cases shaped as a backend delivers them,
every implementation timed, and the library's two paths (host counts, device offsets) giving the
same output as the reference."""

from __future__ import annotations

import torch

from dbo.bench.experts import _apply, format_rows, make_case, run_grid
from dbo.moe import SwiGLUExperts, Workspace, reference_moe, relative_error


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
    assert [(r["local_experts"], r["tokens"]) for r in rows] == [(4, 8), (4, 40), (2, 8), (2, 40)]
    for r in rows:
        assert set(r["results"]) == {"host", "device"}
        assert all(v["median_ms"] > 0 for v in r["results"].values())
        assert r["results"]["device"]["rel_err"] < 1e-6
    table = format_rows(rows, "host").splitlines()
    assert len(table) == 1 + len(rows) and "host/device" in table[0]
    case = make_case(40, 32, 16, 2, num_experts=8, topk=3, dtype=torch.float32, device="cpu", seed=40)
    out = _apply(SwiGLUExperts(use_triton=False), case, False, Workspace())
    assert relative_error(out, reference_moe(case.x, case.w1, case.w2, case.weights, case.ids)) < 1e-5
