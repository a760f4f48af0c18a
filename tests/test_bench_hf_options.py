"""The transformers benchmarks' options values (bad combinations are a ValueError naming the
option) and the records of hf-prefill, hf-generate and hf-load (their JSON, read back, writes the
same JSON)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dbo.bench.hf.options import GenerateOptions, LoadOptions, ModelOptions, PrefillOptions
from dbo.bench.hf.prefill_table import PrefillResult, PrefillRow, verdict_reason

MODEL = ModelOptions(device="cpu", preset="tiny-qwen3_moe", dtype=torch.float32)
LOADED = dataclasses.replace(MODEL, checkpoint="ckpt")


def _prefill(**changes) -> PrefillOptions:
    return PrefillOptions(**{"model": MODEL, "backends": ("naive",), "shapes": ((4, 32),), **changes})


def _generate(**changes) -> GenerateOptions:
    return GenerateOptions(**{"model": MODEL, "pairs": [("all2all", None)], "batch": 4, "prompt": 8,
                              "new_tokens": 4, **changes})


@pytest.mark.parametrize("build, message", [
    (lambda: dataclasses.replace(MODEL, layers=0), "--layers 0: must be >= 1"),
    (lambda: dataclasses.replace(MODEL, remote_fraction=0.0), "--remote-fraction 0.0: want a share"),
    (lambda: dataclasses.replace(MODEL, dtype=torch.float16), "--dtype torch.float16"),
    (lambda: dataclasses.replace(MODEL, checkpoint="a", save_checkpoint="b"),
     "--checkpoint a and --save-checkpoint b: give one"),
    (lambda: _prefill(steps=0), "--steps 0: must be >= 1"),
    (lambda: _prefill(logits_to_keep=-1), "--logits-to-keep -1: must be >= 0"),
    (lambda: _prefill(shapes=((4, 0),)), "--shape 4x0: want BATCHxSEQ"),
    (lambda: _prefill(backends=()), "--backend: want at least one backend"),
    (lambda: _prefill(expert_schedules=("fast",)), "--expert-schedule fast"),
    (lambda: _prefill(tune_sm_carveout=(None, 16)), "--tune-sm-carveout [None, 16]: goes with "
                                                   "--expert-schedule auto"),
    (lambda: _prefill(hf_all_to_all=True), "--hf-all-to-all: needs a loaded model"),
    (lambda: _prefill(ep_experts=("model",)), "--ep-experts: needs a loaded model"),
    (lambda: _prefill(model=LOADED, ep_experts=("mine",)), "--ep-experts mine"),
    (lambda: _generate(new_tokens=0), "--new-tokens 0: must be >= 1"),
    (lambda: _generate(modes=["dbo"]), "--modes: give plain too"),
    (lambda: _generate(sm_carveout=-1), "--sm-carveout -1: must be >= 0"),
    (lambda: _generate(modes=["plain", "fast"]), "--modes plain fast"),
    (lambda: _generate(model=dataclasses.replace(MODEL, device="cuda"), temporary_checkpoint=True),
     "--device cuda: give --checkpoint DIR"),
    (lambda: LoadOptions(dir="ckpt", ranks=0), "--ranks 0: must be >= 1"),
    (lambda: LoadOptions(dir="ckpt", backend="deepep_ll"), "--backend deepep_ll: hf-load runs on CPU"),
    (lambda: LoadOptions(dir="ckpt", worker=True, mode="ep"), "--worker: wants --mode plain or ep"),
])
def test_the_options_refuse_what_no_run_can_honour(build, message):
    with pytest.raises(ValueError) as exc:
        build()
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_options_values_hold_the_defaults_the_commands_use():
    opts = _prefill(shapes=[[4, 32], [2, 64]])
    assert opts.shapes == ((4, 32), (2, 64)) and opts.largest_batch_tokens == 128
    assert opts.experts_choices == (None,)  # a built model: the library's experts
    assert _prefill(model=LOADED).experts_choices == ("auto",)
    written = MODEL.written_to("/tmp/x", write=True)
    assert written.checkpoint == written.save_checkpoint == "/tmp/x" and MODEL.checkpoint is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.steps = 2  # type: ignore[misc]


def test_the_prefill_record_round_trips_to_the_same_json():
    result = PrefillResult(preset="tiny-qwen3_moe", checkpoint=None, layers=2, world=2, device="CPU",
                           dtype=str(torch.float32), steps=5)
    result.rows.append(PrefillRow(backend="naive", batch=4, seq=8, plain_ms=1.0, dbo_ms=0.9, rel_err=1e-7,
                                  top1_agree=1.0, ok=True, split="split(2)", expert_schedule="auto",
                                  autotune={"choice": "split", "plain_ms": 1.0, "split_ms": 0.9,
                                            "merged_ms": 0.95, "sm_carveout": None}))
    result.rows.append(PrefillRow(backend="unconverted", batch=0, seq=0, plain_ms=None, dbo_ms=None,
                                  rel_err=None, top1_agree=None, ok=None, split="out of memory"))
    doc = json.loads(json.dumps(result.to_json()))
    assert set(doc) == {"preset", "checkpoint", "layers", "world", "device", "dtype", "steps",
                        "dbo_disabled", "rows", "emulated"}
    assert doc["dtype"] == "torch.float32" and doc["rows"][0]["autotune"]["choice"] == "split"
    assert json.loads(json.dumps(PrefillResult.from_json(doc).to_json())) == doc
    # the verdict reads the records or their JSON alike
    assert verdict_reason(result.rows, None) == verdict_reason(doc["rows"], None)


def test_the_generate_record_round_trips_to_the_same_json():
    from dbo.bench.hf.generate_table import GenerateResult, GenerateRow, fastest_generate_ms

    result = GenerateResult(model="tiny-qwen3_moe (2 layers, random weights)", world=2, batch=4, prompt=8,
                            new_tokens=4)
    result.rows += [GenerateRow(run="transformers generate (all_to_all)", mode="hf-eager", ms=5.0,
                                prefill_ms=1.0, tok_s=3200.0, same=1.0, prefix=1.0),
                    GenerateRow(run="transformers generate, static cache (all_to_all)", mode="hf-static",
                                error="RuntimeError: no"),
                    GenerateRow(run="dbo greedy_generate all2all plain", mode="plain", ms=2.0, ms_min=1.9,
                                ms_max=2.2, rounds=3, prefill_ms=0.5, tok_s=8000.0, same=1.0, prefix=1.0,
                                same_plain=1.0, prefix_plain=1.0, first_plain=1.0, teacher_forced=1.0,
                                split="plain")]
    doc = json.loads(json.dumps(result.to_json()))
    # the keys hf-generate's --json file has had, the rows last; emulated: None where the run was a group
    assert list(doc) == ["model", "world", "batch", "prompt", "new_tokens", "dbo_disabled", "emulated",
                         "sm_carveout", "rows"]
    assert doc["emulated"] is None and doc["sm_carveout"] is None
    # a row's JSON has the figures it has: the error row its error, the eager row no plan
    assert set(doc["rows"][1]) == {"run", "mode", "error"}
    assert set(doc["rows"][0]) == {"run", "mode", "ms", "prefill_ms", "tok_s", "same", "prefix"}
    assert json.loads(json.dumps(GenerateResult.from_json(doc).to_json())) == doc
    assert fastest_generate_ms(result.rows) == fastest_generate_ms(doc["rows"]) == 5.0


def test_the_load_record_round_trips_to_the_same_json():
    from dbo.bench.hf.load_table import LoadResult, LoadRow
    from dbo.bench.hf.load_table import verdict_reason as load_verdict

    base = dict(rss_after_imports_mib=293.0, load_s=2.5, peak_rss_after_load_mib=348.0,
                rss_after_load_mib=340.0, prefill_s=0.01, peak_rss_after_prefill_mib=354.0)
    result = LoadResult(size_gb=3.6, ranks=2, backend="all2all")
    result.rows += [LoadRow(mode="plain", rank=0, expert_bytes=1000, **base),
                    LoadRow(mode="ep", rank=0, expert_bytes=500, first_forward_s=0.05,
                            first_forward_gathered_bytes=4096, layers_through_dbo=2, dbo_gathered_bytes=0,
                            rel_err_vs_plain=0.0, top1_agree=1.0, logits_match=True, **base),
                    LoadRow(mode="ep", rank=1, expert_bytes=500, first_forward_s=0.05,
                            first_forward_gathered_bytes=4096, layers_through_dbo=2, dbo_gathered_bytes=0,
                            **base)]
    doc = json.loads(json.dumps(result.to_json()))
    # the keys, in the order hf-load's --json file has had them; a row has the figures it has
    assert list(doc) == ["size_gb", "ranks", "backend", "rows"]
    measured = ["mode", "rank", "rss_after_imports_mib", "load_s", "peak_rss_after_load_mib",
                "rss_after_load_mib", "expert_bytes"]
    prefill = ["prefill_s", "peak_rss_after_prefill_mib"]
    ep = ["first_forward_s", "first_forward_gathered_bytes", "layers_through_dbo", "dbo_gathered_bytes"]
    checked = ["rel_err_vs_plain", "top1_agree", "logits_match"]
    assert list(doc["rows"][0]) == measured + prefill
    assert list(doc["rows"][1]) == measured + ep + prefill + checked
    assert list(doc["rows"][2]) == measured + ep + prefill
    again = LoadResult.from_json(doc)
    assert again == result and json.loads(json.dumps(again.to_json())) == doc
    # the verdict reads the records or their JSON alike
    args = LoadOptions(dir="ckpt", check=True, json="load.json")
    assert load_verdict(result.rows, args) == load_verdict(doc["rows"], args) == (
        True, "every ep rank holds 1/2 of the routed experts and its DBOPrefill gathered nothing; "
              "DBO logits match the plain model's; wrote load.json")
    bad = [dataclasses.replace(result.rows[1], expert_bytes=1000, logits_match=False, rel_err_vs_plain=0.5,
                               top1_agree=0.0)]
    assert load_verdict(result.rows[:1] + bad, args) == (
        False, "ep rank 0 holds 1,000 bytes of experts, not 500; ep rank 0's logits differ from the plain "
               "model's (rel err 5.0e-01, top-1 agree 0.00); wrote load.json")


def test_a_dbo_rows_decode_may_miss_a_plain_forwards_choice_up_to_twice_as_often_as_plains():
    from types import SimpleNamespace

    from dbo.bench.hf.generate_table import GenerateRow, tf_floor
    from dbo.bench.hf.generate_table import verdict_reason as generate_verdict

    a = SimpleNamespace(model=SimpleNamespace(dtype=torch.bfloat16, json=None))

    def rows(plain_tf: float, dbo_tf: float, first: float = 0.9) -> list[GenerateRow]:
        return [GenerateRow(run="plain", mode="plain", teacher_forced=plain_tf, same_plain=1.0,
                            first_plain=1.0),
                GenerateRow(run="dbo", mode="dbo", teacher_forced=dbo_tf, same_plain=0.5, first_plain=first)]

    # a model of near ties (random weights): plain misses 9.5%, DBO may miss 19%
    assert tf_floor(0.905) == pytest.approx(0.81)
    assert generate_verdict(a, rows(0.905, 0.846))[0]
    assert not generate_verdict(a, rows(0.905, 0.80))[0]
    # a model of clear choices: the fixed slack
    assert tf_floor(0.999) == pytest.approx(0.979)
    assert generate_verdict(a, rows(0.999, 0.985))[0]
    ok, why = generate_verdict(a, rows(0.999, 0.97))
    assert not ok and "floor 0.979" in why
    # the first new token (the prefill's) still counts on its own
    assert not generate_verdict(a, rows(0.905, 0.9, first=0.5))[0]
