"""The backend registry (``dbo.backends``): every backend is built one way, through its module's
``make_prepare_finalize`` with the same keywords; bad names and options get a ValueError that
names them and what is allowed; a backend built by name runs an overlapped step equal to the
plain one on a 2-rank gloo group."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import torch

from dbo.backends import (
    BACKENDS,
    FACTORY_ARGS,
    BackendSpec,
    backend_options,
    cpu_backends,
    make_backend,
)
from dbo.testing.dist import DistWorld

KW = dict(hidden=16, num_experts=8, topk=2, max_tokens_per_rank=4, device=torch.device("cpu"))


def test_every_backend_module_offers_the_one_factory():
    assert "class_name" not in {f.name for f in dataclasses.fields(BackendSpec)}
    for name, spec in BACKENDS.items():
        factory = importlib.import_module(f"dbo.backends.{spec.module}").make_prepare_finalize
        params = inspect.signature(factory).parameters
        assert next(iter(params)) == "group", name
        for arg in FACTORY_ARGS:
            assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY, (name, arg)


def test_bad_names_and_options_are_named_with_the_allowed_ones():
    listed = r"unknown backend 'nope'; choose from all2all, .*deepep_v2 \(not yet run on GPUs\)"
    with pytest.raises(ValueError, match=listed):
        make_backend("nope", None, dtype=torch.float32, **KW)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backend_options("nope")
    assert backend_options("naive") == ["check_ids_every_call", "check_inputs", "timeout_s",
                                        "use_async"]
    with pytest.raises(ValueError, match="backend 'naive' has no option 'put_order'; its options: "
                                         "check_ids_every_call, check_inputs, timeout_s, use_async"):
        make_backend("naive", None, dtype=torch.float32, put_order="rank", **KW)
    with pytest.raises(TypeError, match="all2all.*float64"):
        make_backend("all2all", None, dtype=torch.float64, **KW)
    with pytest.raises(TypeError, match="bf16"):
        make_backend("deepep_ll", None, dtype=torch.float32, **KW)
    with pytest.raises(ValueError, match="needs max_tokens_per_rank"):
        make_backend("deepep_ll", None, dtype=torch.bfloat16,
                     **{**KW, "max_tokens_per_rank": None})
    assert {"naive", "all2all"} <= set(cpu_backends())
    assert not any(BACKENDS[n].gpu_only for n in cpu_backends())


def _built_by_name(name: str) -> tuple[str, int, float, float]:
    import torch.distributed as dist

    from dbo.experts import relative_error
    from dbo.testing.moe_cases import MoECase, case_inputs, run_case

    case = MoECase(5, (9, 6), 8, topk=3, hidden=16)
    inp = case_inputs(case, dist.get_rank())

    def build():
        return make_backend(name, None, hidden=16, num_experts=8, topk=3, dtype=torch.float32,
                            device="cpu", timeout_s=20.0, use_async=True)

    pf = build()
    seq = run_case(case, inp, pf, use_dbo=False)
    ovl = run_case(case, inp, build(), use_dbo=True)
    return type(pf).__name__, pf.hidden_size, pf.timeout_s, relative_error(ovl, seq)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_backends_built_by_name_overlap_with_the_plain_numbers():
    want = {"naive": "NaivePrepareAndFinalize", "all2all": "AllToAllPrepareAndFinalize"}
    with DistWorld(2) as world:
        for name, cls in want.items():
            for got, hidden, timeout_s, rel in world.run(_built_by_name, name):
                assert (got, hidden, timeout_s) == (cls, 16, 20.0)
                assert rel <= 1e-6, (name, rel)


@pytest.mark.parametrize("fmt", ["standard", "batched_experts"])
def test_the_local_backend_built_by_name_matches_the_reference(fmt):
    import dbo
    from dbo.experts import SwiGLUExperts, make_expert_weights, reference_moe, relative_error
    from dbo.moe import MoEKernel, topk_route

    assert BACKENDS["local"].single_rank and "local" not in cpu_backends()
    assert backend_options("local") == ["activation_format", "use_async"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g)
    weights, ids = topk_route(torch.randn(12, 8, generator=g), 3)
    w1, w2 = make_expert_weights(8, 16, 8, seed=0)
    want = reference_moe(x, w1, w2, weights, ids)
    # no process group: the registry's one way to build a backend, and the kernel over it
    pf = make_backend("local", None, dtype=torch.float32, activation_format=fmt,
                      **{**KW, "topk": 3, "max_tokens_per_rank": 12})
    assert pf.activation_format.value == fmt and pf.num_dispatchers() == 1
    kernel = MoEKernel(pf, SwiGLUExperts())
    assert relative_error(kernel(x, w1, w2, weights, ids, global_num_experts=8), want) <= 1e-5
    halves = dbo.run_ubatches([lambda: kernel(x[:5], w1, w2, weights[:5], ids[:5], global_num_experts=8),
                               lambda: kernel(x[5:], w1, w2, weights[5:], ids[5:], global_num_experts=8)],
                              device="cpu")
    assert relative_error(torch.cat(halves), want) <= 1e-5


def test_the_local_backend_refuses_a_group_of_ranks_and_an_unknown_format(monkeypatch):
    import dbo.backends.local as local

    with pytest.raises(ValueError, match="activation_format must be one of .*'batched_experts'.*got 'slabs'"):
        make_backend("local", None, dtype=torch.float32, activation_format="slabs", **KW)
    monkeypatch.setattr(local, "group_size", lambda group: 2)
    with pytest.raises(ValueError, match="backend 'local' runs on one rank.*the group has 2 ranks"):
        make_backend("local", None, dtype=torch.float32, **KW)
