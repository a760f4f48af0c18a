"""The expert schedules on one GPU: split and merged DBO steps against the plain step, through
the naive backend at world size 1 (an NCCL group of one rank) and the single-process backend in
both activation formats, bf16 and float32; the merge itself never waits for the GPU from the
host. Run on the GPU host: ``pytest tests/gpu/test_schedules_gpu.py``."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from dbo.backends.local import LocalPrepareAndFinalize
from dbo.bench.syncs import format_sites, host_syncs, no_host_syncs
from dbo.moe import ActivationFormat, ExpertTokensMetadata
from dbo.moe.merged import ExpertsInput, merge_inputs
from dbo.testing.moe_cases import MoECase, case_inputs, check_case, run_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module")
def nccl_world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cases(dtype: str) -> list[MoECase]:
    # DeepSeek-like routing on small sizes: many experts, few rows each (where merged pays)
    return [
        MoECase(1, (512,), 64, topk=8, hidden=512, intermediate=256, dtype=dtype, layers=2),
        MoECase(2, (77,), 32, topk=4, hidden=256, intermediate=128, dtype=dtype, routing="padding"),
        MoECase(3, (300,), 16, topk=2, hidden=256, intermediate=64, dtype=dtype,
                reduce_in_experts=False),
    ]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("schedule", ["split", "merged"])
def test_naive_world_of_one_matches_plain(nccl_world_of_one, schedule, dtype):
    from dbo.backends.naive import NaivePrepareAndFinalize

    for case in _cases(dtype):
        rep = check_case(case, 0, lambda: NaivePrepareAndFinalize(timeout_s=60.0), device="cuda",
                         expert_schedule=schedule)
        assert rep.ok, (case, rep)


@pytest.mark.parametrize("schedule", ["plain", "split", "merged"])
def test_naive_steps_never_wait_for_the_gpu(nccl_world_of_one, schedule):
    """After the first call (which reads the ids' range once), a plain or DBO step through the
    naive backend makes no host sync: the GPU never runs dry waiting for the host."""
    from dbo.backends.naive import NaivePrepareAndFinalize

    case = MoECase(1, (512,), 64, topk=8, hidden=512, intermediate=256, dtype="bfloat16", layers=2)
    inp = case_inputs(case, 0, "cuda")
    backend = NaivePrepareAndFinalize(timeout_s=60.0)
    kw = dict(use_dbo=schedule != "plain", device="cuda", expert_schedule=schedule.replace("plain", "split"))
    want = run_case(case, inp, backend, **kw)  # compiles, and reads the ids' range once
    with host_syncs() as sites:
        got = run_case(case, inp, backend, **kw)
    assert not sites, format_sites(sites)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("fmt", list(ActivationFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("schedule", ["split", "merged"])
def test_single_process_backend_matches_plain(fmt, schedule, dtype):
    for case in _cases(dtype):
        rep = check_case(case, 0, lambda: LocalPrepareAndFinalize(fmt), device="cuda",
                         expert_schedule=schedule, num_ubatches=3)
        assert rep.ok, (case, rep)


@pytest.mark.parametrize("fmt", list(ActivationFormat), ids=lambda f: f.name)
def test_merge_and_split_never_wait_for_the_gpu(fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_local, hidden, topk = 8, 128, 4
    inputs = []
    for rows in (40, 0, 23):
        if fmt is ActivationFormat.BATCHED_EXPERTS:
            counts = torch.randint(0, rows + 1, (n_local,), device="cuda", generator=g, dtype=torch.int32)
            a1q = torch.randn(n_local, rows, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
            inputs.append(ExpertsInput(a1q, None, ExpertTokensMetadata(counts), None, None))
        else:
            a1q = torch.randn(rows, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
            ids = torch.randint(-1, n_local, (rows, topk), device="cuda", generator=g)
            w = torch.rand(rows, topk, device="cuda", generator=g)
            counts = torch.zeros(n_local, dtype=torch.int32, device="cuda")
            inputs.append(ExpertsInput(a1q, None, ExpertTokensMetadata(counts), ids, w))
    with no_host_syncs():
        merged, split = merge_inputs(fmt, inputs)
        parts = split(merged.a1q)
    for inp, part in zip(inputs, parts, strict=True):
        assert part.shape == inp.a1q.shape
        if fmt is ActivationFormat.STANDARD:
            assert torch.equal(part, inp.a1q)
        else:  # each expert's valid rows come back at the front of its slab
            for e, c in enumerate(inp.expert_tokens_meta.expert_num_tokens.tolist()):
                assert torch.equal(part[e, :c], inp.a1q[e, :c])
