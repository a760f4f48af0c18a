"""naive and all2all on gloo: the async paths really overlap, and bad input gets clear errors.

Overlap is read from the schedule trace: between a ubatch's collective issue (its recv hook
registration) and the wait for it (that hook running), the other ubatch must have run compute
(an "attention" or "experts" region). Equal numbers alone would not show that.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo.backends.all2all import AllToAllPrepareAndFinalize
from dbo.backends.naive import NaivePrepareAndFinalize
from dbo.backends.torchdist import META_HEADER_LEN, MetaRow
from dbo.experts import SwiGLUExperts, relative_error
from dbo.moe import MoEKernel, MoEProtocolError, TopKWeightAndReduceNoOp
from dbo.testing.moe_cases import MoECase, case_inputs, run_case

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]

BACKENDS = {"naive": NaivePrepareAndFinalize, "all2all": AllToAllPrepareAndFinalize}
COMPUTE_REGIONS = ("attention", "experts", "shared_experts")


def _traced_step(backend: str, layers: int) -> tuple[list[tuple[int, str, int, str]], float]:
    """Runs on every rank: the trace of one overlapped step, and its error vs the plain step."""
    rank = dist.get_rank()
    case = MoECase(7, (9, 6), 8, topk=3, layers=layers)
    inp = case_inputs(case, rank)
    seq = run_case(case, inp, BACKENDS[backend](timeout_s=20.0), use_dbo=False)
    trace = dbo.Trace()
    ovl = run_case(case, inp, BACKENDS[backend](timeout_s=20.0), use_dbo=True, trace=trace)
    return [(e.seq, e.kind, e.ubatch, e.detail) for e in trace.events], relative_error(ovl, seq)


def _overlap_windows(events: list[tuple[int, str, int, str]]) -> list[tuple[int, list[str]]]:
    """For each registered recv hook: (registrant, compute regions other ubatches began between
    the registration and the hook's start)."""
    windows = []
    for i, (_, kind, ub, _) in enumerate(events):
        if kind != "hook_register":
            continue
        j = next(k for k in range(i + 1, len(events))
                 if events[k][1] == "hook_begin" and events[k][3] == str(ub))
        between = [e[3] for e in events[i + 1:j]
                   if e[1] == "region_begin" and e[2] != ub and e[3] in COMPUTE_REGIONS]
        windows.append((ub, between))
    return windows


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_async_paths_overlap_comm_with_other_ubatch_compute(world2, backend):
    layers = 2
    for rank, (events, err) in enumerate(world2.run(_traced_step, backend, layers)):
        assert err <= 1e-5, f"rank {rank}: overlapped differs from plain by {err}"
        windows = _overlap_windows(events)
        # dispatch and combine of both ubatches in every layer
        assert len(windows) == 4 * layers, windows
        # the step's final combine has nothing left to overlap with: the other ubatch is done
        # with its compute and runs the hook as it finishes
        empty = [w for w in windows[:-1] if not w[1]]
        timeline = "\n".join(f"{s:4d} ub{u} {k} {d}" for s, k, u, d in events)
        assert not empty, f"rank {rank}: no compute overlapped these waits: {empty}\n{timeline}"
        kinds = {d for _, b in windows for d in b}
        assert {"attention", "experts"} <= kinds


def _bad_inputs(backend: str) -> list[tuple[str, str, str]]:
    """Runs on every rank (same bad input everywhere, so every rank fails before any
    collective); returns (case, exception type, message)."""
    rank = dist.get_rank()
    pf = BACKENDS[backend](timeout_s=20.0, hidden_size=16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    w = torch.rand(4, 2, generator=g)
    ids = torch.randint(0, 8, (4, 2), generator=g, dtype=torch.int32)
    cases = {
        "a1 dtype": (x.double(), w, ids, 8),
        "topk_weights dtype": (x, w.to(torch.bfloat16), ids, 8),
        "topk_ids dtype": (x, w, ids.float(), 8),
        "topk_ids range": (x, w, ids + 8, 8),
        "shape mismatch": (x, w[:3], ids, 8),
        "hidden size": (x[:, :8], w, ids, 8),
        "experts not divisible": (x, w, ids % 7, 7),
    }
    out = []
    for name, (a, tw, ti, e) in cases.items():
        try:
            pf.prepare(a, tw, ti, e, None, False)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append((name, type(exc).__name__, str(exc)))
        else:
            out.append((name, "no error", ""))
    # ranks disagree on the hidden size: found by the metadata exchange, on every rank at once
    pf = BACKENDS[backend](timeout_s=20.0)
    hidden = 16 if rank == 0 else 8
    try:
        pf.prepare(torch.randn(4, hidden), w, ids, 8, None, False)
    except Exception as exc:  # noqa: BLE001
        out.append(("ranks disagree", type(exc).__name__, str(exc)))
    # finalize with no prepare
    try:
        pf.finalize(torch.zeros(4, 16), torch.zeros(4, 16), w, ids, False, TopKWeightAndReduceNoOp())
    except MoEProtocolError as exc:
        out.append(("finalize first", type(exc).__name__, str(exc)))
    if backend == "all2all":
        try:
            pf.prepare(x, w, ids, 8, torch.arange(8, dtype=torch.int32), False)
        except Exception as exc:  # noqa: BLE001
            out.append(("expert_map", type(exc).__name__, str(exc)))
    # the group is still in step: a good call works afterwards
    k = MoEKernel(BACKENDS[backend](timeout_s=20.0), SwiGLUExperts())
    w1 = torch.randn(4, 8, 16, generator=g)
    w2 = torch.randn(4, 16, 4, generator=g)
    k(x, w1, w2, w, ids, global_num_experts=8)
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bad_input_raises_clear_errors(world2, backend):
    want = {
        "a1 dtype": ("TypeError", "hidden_states"),
        "topk_weights dtype": ("TypeError", "topk_weights"),
        "topk_ids dtype": ("TypeError", "topk_ids"),
        "topk_ids range": ("ValueError", "topk_ids"),
        "shape mismatch": ("ValueError", "topk_weights"),
        "hidden size": ("ValueError", "hidden_size=16"),
        "experts not divisible": ("ValueError", "num_experts"),
        "ranks disagree": ("ValueError", "differs across ranks"),
        "finalize first": ("MoEProtocolError", "no prepare"),
    }
    if backend == "all2all":
        want["expert_map"] = ("ValueError", "expert_map")
    for rank, got in enumerate(world2.run(_bad_inputs, backend)):
        got = {name: (t, msg) for name, t, msg in got}
        assert set(got) == set(want), (rank, got)
        for name, (etype, needle) in want.items():
            assert got[name][0] == etype and needle in got[name][1], (rank, name, got[name])


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process (the expert-map check needs no peer)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_expert_map_check_is_not_fooled_by_a_reused_id(one_rank_group):
    # A map that passed the check is remembered; a new map that CPython puts at the freed one's
    # address (same id(), both at version 0) must be checked afresh, and so must a remembered
    # map used with another number of experts.
    pf = AllToAllPrepareAndFinalize(timeout_s=20.0)
    x, w = torch.randn(4, 16), torch.rand(4, 2)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    for _ in range(200):
        good = torch.tensor(list(range(8)), dtype=torch.int32)
        pf.prepare(x, w, ids, 8, good, False)
        pf.reset()
        freed = id(good)
        del good
        bad = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.int32)
        if id(bad) == freed:
            break
    assert id(bad) == freed, "CPython never reused a freed tensor's address: the test proves nothing"
    assert bad._version == 0
    with pytest.raises(ValueError, match="expert_map"):
        pf.prepare(x, w, ids, 8, bad, False)
    good = torch.arange(8, dtype=torch.int32)
    pf.prepare(x, w, ids, 8, good, False)
    pf.reset()
    with pytest.raises(ValueError, match="expert_map"):
        pf.prepare(x, w, ids.mul(2), 16, good, False)


def test_metadata_rows_name_their_columns():
    # all2all's send counts travel after the header every backend sends; they are read by name,
    # so the header can grow without a backend reading a header field as a count
    row = MetaRow(5, 16, 2, 0, 8, 1, extra=(3, 4))
    assert row.as_list() == [5, 16, 2, 0, 8, 1, 3, 4]
    assert MetaRow.parse(row.as_list()) == row
    assert len(row.as_list()) - len(row.extra) == META_HEADER_LEN
    assert MetaRow.parse([5, 16, 2, 0, 8, 1]).extra == ()
