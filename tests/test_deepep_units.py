"""Single-process tests of the DeepEP helpers: install errors, API detection, the buffer cache,
hidden padding, fp8 blocks, the v2 expanded layout, the low-latency bookkeeping."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dbo import run_ubatches
from dbo.backends.deepep import buffer as db
from dbo.backends.deepep_ll import (
    LowLatencyLimitError,
    LowLatencyResults,
    low_latency_hidden,
    low_latency_max_tokens,
)
from dbo.backends.deepep_v2 import expanded_row_experts
from dbo.backends.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from dbo.testing.fake_deep_ep import install_fake_deep_ep, make_fake_deep_ep


@pytest.fixture(autouse=True)
def _no_buffer_left_behind():
    """The process-wide DeepEP buffer cache is empty after every test (house rule 3)."""
    yield
    assert len(db.BUFFER_CACHE) == 0, "a test left a DeepEP buffer in BUFFER_CACHE"


class _Group:
    """Enough of a process group for the fake buffers' constructors (no collectives)."""

    def __init__(self, size: int = 2, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_missing_deep_ep_names_the_install_step(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` fail
    with pytest.raises(db.DeepEPNotInstalledError) as info:
        db.import_deep_ep()
    msg = str(info.value)
    assert isinstance(info.value, ImportError)
    assert "offline_wheels.sh" in msg and "tokenspeed-deepep==1.2.1.post20251110" in msg
    with pytest.raises(db.DeepEPNotInstalledError):
        db.get_deepep_buffer(_Group(), mode="ht", hidden=256, max_tokens_per_rank=8, num_experts=8,
                             topk=2, cache=db.DeepEPBufferCache())


#: run in a fresh interpreter: this module imported the backends already, so importing them
#: here again would be a cached no-op. A finder first on the meta path refuses deep_ep and
#: records every attempt, so a guarded (try/except) import at import time is caught too.
_IMPORT_WITHOUT_DEEP_EP = textwrap.dedent("""
    import sys

    attempts = []

    class NoDeepEP:
        def find_spec(self, name, path=None, target=None):
            if name == "deep_ep" or name.startswith("deep_ep."):
                attempts.append(name)
                raise ModuleNotFoundError(f"no module named {name!r} (refused by the test)")
            return None

    sys.modules.pop("deep_ep", None)
    sys.meta_path.insert(0, NoDeepEP())
    import dbo.backends.deepep_ht
    import dbo.backends.deepep_ll
    import dbo.backends.deepep_v2
    from dbo.backends import BACKENDS

    assert {"deepep_ht", "deepep_ll", "deepep_v2"} <= set(BACKENDS), sorted(BACKENDS)
    assert not attempts, f"importing the DeepEP backends imported {attempts}"
    assert "deep_ep" not in sys.modules
    print("imported without deep_ep")
""")


def test_backends_import_without_deep_ep():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_DEEP_EP], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported without deep_ep", proc.stdout


@pytest.mark.parametrize("api, v1, v2", [("v1", True, None), ("v2-elastic", True, "ElasticBuffer"),
                                         ("v2-ep", True, "EPBuffer")])
def test_api_detection(api, v1, v2):
    info = db.detect_deep_ep_api(make_fake_deep_ep(api))
    assert (info.buffer_cls is not None) == v1
    assert info.v2_name == v2
    assert (v2 or "no ElasticBuffer") in info.describe()


def test_v2_mode_on_a_v1_install_is_a_clear_error():
    with install_fake_deep_ep("v1"), pytest.raises(db.DeepEPAPIError, match="ElasticBuffer or EPBuffer"):
        db.get_deepep_buffer(_Group(), mode="v2", hidden=256, max_tokens_per_rank=8, num_experts=8,
                             topk=2, cache=db.DeepEPBufferCache())


def test_cache_reuses_grows_and_resets():
    cache = db.DeepEPBufferCache()
    group = _Group()
    with install_fake_deep_ep("v1"):
        a = db.get_deepep_buffer(group, mode="ht", hidden=512, max_tokens_per_rank=1, num_experts=8,
                                 topk=2, cache=cache)
        first = a.buffer
        b = db.get_deepep_buffer(group, mode="ht", hidden=256, max_tokens_per_rank=1, num_experts=8,
                                 topk=4, cache=cache)
        assert b is a and a.buffer is not first  # topk grew: a new buffer, the old one destroyed
        assert first.runtime is None and a.generation == 1 and a.request.hidden == 512
        c = db.get_deepep_buffer(group, mode="ht", hidden=256, max_tokens_per_rank=1, num_experts=8,
                                 topk=2, cache=cache)
        assert c is a and c.generation == 1  # covered: reused
        ll = db.get_deepep_buffer(group, mode="ll", hidden=2048, max_tokens_per_rank=8, num_experts=8,
                                  topk=2, cache=cache)
        assert ll is not a and ll.buffer.low_latency_mode and ll.buffer.num_qps_per_rank == 4
        assert len(cache) == 2
        held = [a.buffer, ll.buffer]
        cache.reset()
        assert len(cache) == 0 and all(b.runtime is None for b in held)
    with pytest.raises(ValueError, match="positive"):
        db.get_deepep_buffer(group, mode="ht", hidden=0, max_tokens_per_rank=1, num_experts=8, topk=2,
                             cache=cache)


def test_low_latency_request_needs_the_same_expert_count():
    r = db.BufferRequest(db.BufferMode.LOW_LATENCY, 2048, 64, 16, 8)
    assert r.covers(db.BufferRequest(db.BufferMode.LOW_LATENCY, 2048, 32, 16, 2))
    assert not r.covers(db.BufferRequest(db.BufferMode.LOW_LATENCY, 2048, 32, 8, 2))


def test_hidden_padding():
    assert db.round_up_hidden(200, torch.bfloat16) == 256
    assert db.round_up_hidden(2048, torch.bfloat16) == 2048
    assert db.round_up_hidden(7168, torch.bfloat16) == 7168
    assert db.round_up_hidden(320, torch.float8_e4m3fn) == 512
    with pytest.raises(ValueError):
        db.round_up_hidden(0, torch.bfloat16)
    assert low_latency_hidden(256) == 2048 and low_latency_hidden(7168) == 7168
    with pytest.raises(ValueError, match="support"):
        low_latency_hidden(9000)
    assert [low_latency_max_tokens(m, r) for m, r in [(5, 2), (5, 4), (3, 1), (128, 2)]] == [6, 5, 4, 128]


@given(st.integers(1, 64), st.sampled_from([128, 256, 512]), st.integers(0, 2**31 - 1))
def test_fp8_blocks_round_trip(m, h, seed):
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(seed)) * 3
    q, s = quantize_fp8_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, h // 128) and s.dtype == torch.float32
    back = dequantize_fp8_blocks(q, s, torch.float32)
    assert torch.linalg.vector_norm(back - x) <= 0.07 * torch.linalg.vector_norm(x)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.sampled_from([1, 2, 4]))
def test_expanded_row_experts_matches_a_python_model(counts, align):
    starts, psum, pos = [], [], 0
    for c in counts:
        start = -(-pos // align) * align
        starts.append(start)
        psum.append(start + c)
        pos = start + c
    rows = -(-pos // align) * align + 3  # trailing capacity rows too
    want = [-1] * rows
    for e, (s, c) in enumerate(zip(starts, counts, strict=True)):
        for r in range(s, s + c):
            want[r] = e
    got = expanded_row_experts(torch.tensor(psum, dtype=torch.int32), rows, align)
    assert got.tolist() == want


def test_low_latency_results_limit_and_pending_receive():
    r = LowLatencyResults()
    a = r.acquire("dispatch")
    with pytest.raises(LowLatencyLimitError, match="has not run"):
        r.acquire("dispatch")
    r.received(a)
    b = r.acquire("dispatch")
    r.received(b)
    with pytest.raises(LowLatencyLimitError, match="third low-latency result"):
        r.acquire("dispatch")
    r.release(a)
    c = r.acquire("combine")
    assert len(r) == 2
    r.reset()
    assert len(r) == 0 and c != b


def test_low_latency_results_left_by_another_step_are_dropped(caplog):
    r = LowLatencyResults()
    t = r.acquire("dispatch")  # outside a run, never released (a failed step)
    r.received(t)
    r.acquire("dispatch")
    seen = []

    def ub(i):
        def fn():
            tok = r.acquire("dispatch")
            r.received(tok)
            seen.append(len(r))
        return fn

    run_ubatches([ub(0), ub(1)], device="cpu")
    assert seen == [1, 2]  # the two stale results were dropped at the run's first launch
    assert "left by an earlier step" in caplog.text
