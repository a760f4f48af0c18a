"""Backends are asked for traits (:class:`dbo.backends.BackendSpec`), not compared by name: a new
backend with a trait is treated as the one the old name check meant, wherever it is asked."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dbo import cli
from dbo.backends import BACKENDS, BackendSpec, describe_backend
from dbo.bench.overlap import args as overlap_args
from dbo.bench.overlap.capture import GRAPH_BACKENDS


def test_the_traits_of_the_registered_backends():
    def having(trait: str) -> set[str]:
        return {n for n, s in BACKENDS.items() if getattr(s, trait)}

    assert having("uses_deep_ep") == {"deepep_ht", "deepep_ll", "deepep_v2"}
    assert having("low_latency") == {"deepep_ll"}
    assert having("sets_num_sms") == {"deepep_ht"}
    assert having("graph_capturable") == {"deepep_ll", "copy_engine"} == set(GRAPH_BACKENDS)
    assert {n for n, s in BACKENDS.items() if not s.run_on_gpus} == {"deepep_v2"}
    assert describe_backend("deepep_v2") == "deepep_v2 (not yet run on GPUs)"


def _with(monkeypatch, module, **specs: BackendSpec) -> None:
    monkeypatch.setattr(module, "BACKENDS", {**BACKENDS, **specs})


class _Exit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # noqa: D102 - a refusal, as an exception the test can catch
        raise _Exit(message)


def test_a_backend_on_deep_ep_runs_on_the_fake_by_its_trait(monkeypatch):
    # gpu-only backends run on the CPU under --fake-deep-ep only where they are built on DeepEP
    ours = BackendSpec("ours", "deepep_ht", gpu_only=True, uses_deep_ep=True)
    other = dataclasses.replace(ours, name="other", uses_deep_ep=False)
    _with(monkeypatch, cli, ours=ours, other=other)
    cli.check_backend_fits(_Parser(), "ours", device="cpu", fake_deep_ep=True)
    with pytest.raises(_Exit, match="--backend other needs --device cuda"):
        cli.check_backend_fits(_Parser(), "other", device="cpu", fake_deep_ep=True)
    with pytest.raises(_Exit, match="--backend ours needs --device cuda"):
        cli.check_backend_fits(_Parser(), "ours", device="cpu", fake_deep_ep=False)


def test_bench_overlap_sizes_a_low_latency_backend_as_decode_by_its_trait(monkeypatch):
    from dbo.bench.overlap import options as overlap_options

    fast = BackendSpec("fast", "deepep_ll", gpu_only=True, bf16_only=True, low_latency=True)
    _with(monkeypatch, overlap_args, fast=fast,
          wide=BackendSpec("wide", "deepep_ht", gpu_only=True, sets_num_sms=True),
          plain=BackendSpec("plain", "all2all"))

    def defaults(layout: str, device: str = "cuda") -> dict:
        return overlap_args.defaults(device, layout, quick=False, emulated=False)

    assert defaults("fast")["tokens"] == [32, 64, 128, 256, 512] and defaults("fast")["layers"] == 4
    assert defaults("fast")["num_sms"] == []
    assert defaults("wide")["tokens"] == [1024, 4096, 16384] and defaults("wide")["num_sms"] == [24, 32, 48]
    assert defaults("plain")["tokens"] == defaults("wide")["tokens"] and defaults("plain")["num_sms"] == []
    # on the CPU: a bf16-only layout is run in bf16, any other in float32
    assert defaults("fast", "cpu")["dtype"] == "bfloat16" and defaults("plain", "cpu")["dtype"] == "float32"
    # and its split decisions are the decode thresholds
    import dbo.backends

    monkeypatch.setattr(dbo.backends, "BACKENDS", {**BACKENDS, "fast": fast})
    for backend, decode in (("fast", True), ("deepep_ht", False)):
        opts = overlap_options.OverlapOptions(backend=backend, device="cpu", **defaults(backend, "cpu"))
        assert opts.decode is decode


def test_bench_overlap_lists_deepep_v2_as_not_yet_run_on_gpus(capsys):
    from dbo.bench.overlap.options import OverlapOptions

    values = overlap_args.defaults("cpu", "all2all", quick=True, emulated=False)
    with pytest.raises(ValueError, match=r"--backend nope: unknown .*deepep_v2 \(not yet run on GPUs\)"):
        OverlapOptions(backend="nope", device="cpu", **values)
    with pytest.raises(SystemExit):
        overlap_args.parse_args(["--help"])
    assert "deepep_v2 (not yet run on GPUs)" in " ".join(capsys.readouterr().out.split())


def test_the_bench_counts_a_backends_bytes_by_its_traffic(monkeypatch):
    import torch

    from dbo.bench.overlap import link

    ids = torch.tensor([[0, 2, 3], [5, 7, -1]])
    kw = dict(world_size=4, rank=0, num_experts=8, hidden=10, elem_bytes=2)
    mine = {f"mine_{t}": BackendSpec(f"mine_{t}", "all2all", traffic=t)
            for t in ("per_rank", "per_expert", "to_every_rank", "gather")}
    _with(monkeypatch, link, **mine)
    for like, traffic in (("all2all", "per_rank"), ("deepep_ll", "per_expert"),
                          ("copy_engine", "to_every_rank"), ("naive", "gather")):
        assert link.comm_bytes(f"mine_{traffic}", ids, **kw) == link.comm_bytes(like, ids, **kw)
    with pytest.raises(ValueError, match="knows"):
        link.comm_bytes("local", ids, **kw)  # one rank: nothing moves
    with pytest.raises(ValueError, match="traffic"):
        BackendSpec("bad", "all2all", traffic="carrier pigeon")
