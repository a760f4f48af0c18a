"""The overlap benchmark (``python -m dbo.bench overlap``) through each backend's own paths, in
torchrun smoke runs on gloo whose JSON bundles must have the documented structure: the DeepEP
backends on the fake ``deep_ep``, copy_engine with a constructor option, and all2all under a
simulated link with every mode (the grouped sbo schedules among them). The command, the default
run's bundle and its reports: tests/test_bench_overlap.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_overlap_checks import check_grouped_modes, check_structure, run_bench

from dbo.bench.overlap.args import MODES

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(180)]

#: two timed steps and no warm-up per configuration: these runs check each backend's code paths and
#: the bundle's structure (the default step counts: the naive run of tests/test_bench_overlap.py)
STEPS = ("--steps", "2", "--warmup", "0")


@pytest.mark.parametrize("backend, extra, sms", [
    ("deepep_ht", ["--num-sms", "24", "32"], [24, 32]),
    ("deepep_ll", ["--tokens", "32", "--ll-rows", "auto"], []),
    ("deepep_ll", ["--tokens", "32", "--modes", *MODES, "--sbo-groups", "4"], []),
])
def test_bench_deepep_paths_on_fake(tmp_path, backend, extra, sms):
    # the fake deep_ep (dbo.testing) runs the DeepEP code paths of the benchmark on gloo:
    # SM-count switching, record/replay, the low-latency row bound (--ll-rows auto) or none
    # (the default: the experts take the rows that arrived from the device counts); the grouped
    # schedules with four groups of low-latency combines
    bundle = run_bench(tmp_path, "--backend", backend, "--fake-deep-ep", *extra, *STEPS)
    sh = bundle["shapes"][0]
    grouped = ("sbo", "sbo_dbo") if "--modes" in extra else ()
    check_structure(bundle, backend, sms, grouped)
    if grouped:  # every mode, the grouped ones with four groups of low-latency combines
        assert bundle["args"]["sbo_groups"] == 4
        check_grouped_modes(sh)
    if backend == "deepep_ll":
        rows = sh["ll_rows"]
        if "auto" in extra:
            assert 0 < rows["dbo"] <= rows["serial"] <= 2 * sh["tokens"]
            assert rows["dbo"] <= rows["merged"] <= 2 * rows["dbo"] + 16
        else:
            assert rows == {"serial": None, "dbo": None, "merged": None}
        assert bundle["crossover"][0]["intermediate"] == sh["intermediate"]
    else:
        assert bundle["env"]["deepep_setup"]["deep_ep_default_num_sms"] == 20


def test_bench_copy_engine_with_backend_opt(tmp_path):
    bundle = run_bench(tmp_path, "--backend", "copy_engine", "--backend-opt", "put_order=rank", *STEPS)
    check_structure(bundle, "copy_engine", [])
    assert bundle["args"]["backend_kwargs"] == {"put_order": "rank"}
    s = bundle["shapes"][0]["summary"]
    assert s["comm_bytes"] == 64 * (2 * bundle["args"]["hidden"] * 4 + 2 * bundle["args"]["topk"] * 4)
    from dbo.bench.compare import label

    assert label(bundle) == "copy_engine[put_order=rank]"


@pytest.fixture(scope="module")
def linked_run(tmp_path_factory) -> dict:
    """The bundle of one all2all run under a simulated link, every mode measured (the grouped sbo
    schedules too, whose held-back combines go through the link's own path), which two tests read."""
    folder: Path = tmp_path_factory.mktemp("linked")
    return run_bench(folder, "--backend", "all2all", "--link", "1000,5000", "--remote-fraction", "0.875",
                     "--link-order", "host", "--modes", *MODES, *STEPS)


def test_bench_under_a_simulated_link(linked_run):
    bundle = linked_run
    check_structure(bundle, "all2all", [], ("sbo", "sbo_dbo"))
    sim = bundle["env"]["simulated_link"]
    from dbo.backends.simulated_link import wait_clock

    assert sim == {"gbps": 1000.0, "latency_us": 5000.0, "remote_fraction": 0.875,
                   "combine_latency_us": None, "order": "host", "name": "",
                   "formula": "arrival >= send + latency_us + remote_fraction * bytes / gbps",
                   "wait_clock": wait_clock()}
    s = bundle["shapes"][0]["summary"]
    assert s["comm_ms"] >= 2 * 5.0  # a dispatch and a combine per layer, each past its latency


def test_sbo_mode_is_measured_and_checked(linked_run):
    # the unsplit sbo step and the split sbo+dbo one (on all2all, not a DeepEP backend): timed
    # beside serial and checked against the same reference
    check_grouped_modes(linked_run["shapes"][0])
