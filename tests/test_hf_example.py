"""The transformers entry points as a user runs them, in subprocesses on CPU (gloo):
``examples/hf_expert_parallel.py`` and ``python -m dbo.bench hf-prefill|hf-generate|hf-load``
under torchrun. Each run that completes ends in one verdict line and writes JSON whose rows say
that DBO's logits (or tokens) equal the plain run's; each bad input ends in one line on stderr
naming the bad value and what is allowed, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from dbo.testing.launch import run_entry

pytest.importorskip("transformers")

pytestmark = [pytest.mark.long_file, pytest.mark.multiproc, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
BENCH = ["-m", "dbo.bench"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DBO_DISABLE", None)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 150) -> tuple[int, str, str]:
    """``cmd`` in a process of its own (a fresh interpreter, as a user starts it)."""
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _ranks(argv: list[str], cwd: Path, timeout: float = 150, nproc: int | None = 2) -> tuple[int, str, str]:
    """``torchrun --nproc-per-node 2 ARGV`` as torchrun starts its ranks (``nproc=None``: ``python
    ARGV``), forked from a process that has imported torch and transformers (dbo.testing.launch)."""
    run = run_entry(argv, nproc=nproc, cwd=cwd, env=_env(), timeout=timeout)
    return run.returncode, run.stdout, run.stderr


def _needs_ep_loading() -> None:
    pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers < 5.23")
    pytest.importorskip("accelerate")


def test_example_checks_dbo_against_plain(tmp_path):
    rc, out, err = _ranks([str(ROOT / "examples" / "hf_expert_parallel.py"), "--family", "deepseek_v3"],
                           tmp_path)
    assert rc == 0, out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith("hf_expert_parallel.py: PASS: DBOPrefill's logits equal"), out


def test_hf_prefill_on_cpu(tmp_path):
    out_json = tmp_path / "hf.json"
    rc, out, err = _ranks([*BENCH, "hf-prefill", "--preset", "tiny-deepseek_v3", "--shape", "3x8",
                         "--steps", "1", "--warmup", "0", "--logits-to-keep", "0", "--unconverted",
                         "--json", str(out_json), "--expert-schedule", "split", "auto",
                         "--tune-sm-carveout", "none", "0"], tmp_path)
    assert rc == 0, out + err
    assert "| backend | batch x seq | plain ms | DBO ms |" in out, out
    # on CPU: per rank, no peak-memory column; the footnote because --unconverted ran
    assert "per GPU" not in out and "peak GiB" not in out, out
    assert "(unconverted: the original model" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("hf-prefill: PASS: DBO matches plain on every row (max rel err "), out
    assert "; the unconverted model matches the converted one" in last and last.endswith(f"wrote {out_json}")
    rows = json.loads(out_json.read_text())["rows"]
    labels = [r["backend"] for r in rows]
    assert labels[::2] == ["all2all/split", "copy_engine/split", "naive/split", "unconverted"], labels
    for label, r in zip(labels[:-1], rows[:-1], strict=True):
        assert r["plain_peak_gib"] is None and r["dbo_peak_gib"] is None, r
        if label.endswith("/split"):
            assert r["split"].startswith("split("), r
            continue
        # the autotune's row: its choice among plain, split, merged and sbo (unsplit), each timed
        choice = r["autotune"]["choice"]
        assert label == f"{label.split('/')[0]}/auto ({choice})", r
        assert choice in ("plain", "split", "merged", "sbo"), r
        assert r["autotune"]["plain_ms"] > 0 and r["autotune"]["sm_carveout"] in (None, 0), r
        assert r["split"].startswith("plain" if choice in ("plain", "sbo") else "split("), r
    for r in rows:
        assert r["rel_err"] <= 1e-4 and r["top1_agree"] == 1.0 and r["ok"] is True, r


def test_hf_prefill_without_unconverted_has_no_footnote(tmp_path):
    rc, out, err = _ranks([*BENCH, "hf-prefill", "--backend", "naive", "--shape", "2x4",
                         "--steps", "1", "--warmup", "0"], tmp_path)
    assert rc == 0, out + err
    assert "unconverted" not in out, out
    assert out.strip().splitlines()[-1].startswith("hf-prefill: PASS: DBO matches plain on every row"), out


def test_hf_prefill_under_dbo_disable_says_dbo_was_off(tmp_path):
    out_json = tmp_path / "prefill.json"
    run = run_entry([*BENCH, "hf-prefill", "--backend", "naive", "--shape", "2x4", "--steps", "1",
                     "--warmup", "0", "--json", str(out_json)], nproc=2, cwd=tmp_path,
                    env={**_env(), "DBO_DISABLE": "1"}, timeout=150)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "DBO_DISABLE=1: DBO was disabled in this run" in out, out
    row = next(ln for ln in out.splitlines() if ln.startswith("| naive |"))
    assert "| off |" in row and not re.search(r"\d\.\d\dx", row), row
    assert "\n  plain ms, DBO ms: the prefill forward" in out and "DBO speedup: plain ms / DBO ms" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("hf-prefill: PASS: DBO_DISABLE=1: DBO was disabled"), out
    assert "DBO matches plain" not in out, out
    assert json.loads(out_json.read_text())["dbo_disabled"] is True


def test_hf_prefill_loads_a_checkpoint(tmp_path):
    # --save-checkpoint writes a tiny Mixtral (every rank its share); it is then loaded
    # expert-parallel through from_pretrained with dbo's backends as transformers' EP
    # implementations, both experts choices, under a simulated link
    _needs_ep_loading()
    out_json = tmp_path / "ckpt.json"
    rc, out, err = _ranks([*BENCH, "hf-prefill", "--preset", "tiny-mixtral", "--save-checkpoint",
                         str(tmp_path / "ckpt"), "--backend", "all2all", "copy_engine", "--shape", "3x8",
                         "--steps", "1", "--warmup", "0", "--logits-to-keep", "0", "--unconverted",
                         "--json", str(out_json), "--ep-experts", "library", "model",
                         "--link", "1000,2000", "--remote-fraction", "0.875"], tmp_path)
    assert rc == 0, out + err
    assert "(loaded expert-parallel)" in out, out
    assert "GiB" not in out, out  # no GPU memory on the CPU, in the load lines either
    assert out.strip().splitlines()[-1].startswith("hf-prefill: PASS: "), out
    result = json.loads(out_json.read_text())
    assert result["checkpoint"] == str(tmp_path / "ckpt")
    rows = result["rows"]
    assert [r["backend"] for r in rows] == [f"{b} ({e} experts)" for e in ("library", "model")
                                            for b in ("all2all", "copy_engine")] + ["unconverted"]
    for r in rows:  # DBO == plain per backend; the whole model == the expert-parallel one
        assert r["rel_err"] <= 1e-4 and r["top1_agree"] == 1.0, r
    # under the simulated link (2 ms a transfer, a dispatch and a combine per layer)
    assert "simulated link: 1000 GB/s, 2000 us fixed" in out, out
    layers = result["layers"]
    assert all(r["plain_ms"] >= 2 * 2.0 * layers for r in rows[:-1]), rows


def test_hf_generate_agrees_with_generate(tmp_path):
    # greedy decoding: transformers' generate() with its own all_to_all EP, then dbo's
    # greedy_generate on a backend and on a prefill/decode pair, plain, overlapped and from a
    # static cache (the graph rows: eager on CPU); float32, so every run's tokens agree, and each
    # is what one plain forward over the whole sequences picks
    _needs_ep_loading()
    out_json = tmp_path / "gen.json"
    # no checkpoint option: the preset goes to a temporary directory, removed at the end
    rc, out, err = _ranks([*BENCH, "hf-generate",
                         "--steps", "1", "--warmup", "0", "--backend", "all2all", "copy_engine/all2all",
                         "--modes", "plain", "dbo-prefill", "dbo", "graph", "--json", str(out_json)],
                        tmp_path)
    assert rc == 0, out + err
    assert "per GPU" not in out, out
    assert [p.name for p in tmp_path.iterdir()] == ["gen.json"]  # nothing else where it ran
    written = re.search(r"^wrote (\S+): ", out, re.MULTILINE)
    assert written and "dbo-hf-generate-" in written[1] and not Path(written[1]).exists(), out
    # the table is titled by the model, not by where its checkpoint was
    assert "\ntiny-qwen3_moe (2 layers, random weights): batch 4 x prompt 8 + 4 new tokens" in out, out
    assert json.loads(out_json.read_text())["model"] == "tiny-qwen3_moe (2 layers, random weights)"
    assert out.strip().splitlines()[-1] == (f"hf-generate: PASS: every DBO run's tokens equal its plain "
                                            f"run's (6 runs); wrote {out_json}"), out
    rows = json.loads(out_json.read_text())["rows"]
    # transformers' eager generate() and its static-cache fast path (not compiled on the CPU),
    # then dbo's rows; the speed-up line is against the faster of the first two
    assert [r["run"] for r in rows] == ["transformers generate (all_to_all)",
                                        "transformers generate, static cache (all_to_all)"] + [
        f"dbo greedy_generate {b} {m}" for b in ("all2all", "copy_engine/all2all")
        for m in ("plain", "DBO prefill", "DBO", "plain, graph decode")]
    assert all(r["same"] == 1.0 and r["prefix"] == 1.0 and r["tok_s"] > 0 for r in rows), rows
    assert all(r["prefill_ms"] > 0 for r in rows), rows
    dbo_rows = rows[2:]
    assert all(r["same_plain"] == 1.0 and r["prefix_plain"] == 1.0 for r in dbo_rows), rows
    assert all(r["teacher_forced"] == 1.0 for r in dbo_rows), rows
    assert all(r["split"].startswith("split(") for r in dbo_rows if "DBO" in r["run"]), rows
    fastest = min(r["ms"] for r in rows[:2])
    best = min(dbo_rows, key=lambda r: r["ms"])
    assert f"fastest dbo run: {best['run']}, {fastest / best['ms']:.2f}x the faster of transformers'" in out


# ---- the front door: one line, exit code 2, no traceback ------------------------------------

BAD = [
    (["hf-prefill", "--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: no such directory"),
    (["hf-prefill", "--layers", "-1"], "--layers -1: must be >= 1"),
    (["hf-prefill", "--backend", "nope"], "unknown backend 'nope'; choose from all2all, "),
    (["hf-prefill", "--shape", "4y3"], "--shape: '4y3': want BATCHxSEQ"),
    (["hf-prefill", "--backend", "deepep_ht"], "--backend deepep_ht needs --device cuda"),
    (["hf-generate", "--backend", "all2all/nope"], "unknown backend 'nope'; choose from"),
    (["hf-generate", "--new-tokens", "0"], "--new-tokens 0: must be >= 1"),
    # one rank: transformers would load the checkpoint whole
    (["hf-generate"], "loading the checkpoint expert-parallel needs 2 or more ranks (torchrun"),
    (["hf-prefill", "--save-checkpoint", "ckpt"],
     "--save-checkpoint ckpt: loading it expert-parallel needs 2 or more ranks"),
    (["hf-load", "--dir", "/nonexistent", "--ranks", "3"], "--ranks 3: the checkpoint's 128 routed experts"),
    (["hf-load", "--dir", "/nonexistent", "--backend", "deepep_ll"],
     "--backend deepep_ll: hf-load runs on CPU"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, argv, message):
    # the command's own main, in this process (a process per case costs seconds of imports);
    # the first case also goes through `python -m dbo.bench` as a user runs it
    from dbo.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DBO_DISABLE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one rank, as `python -m dbo.bench` is
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    runs = [err]
    if (argv, message) == BAD[0]:
        rc, out, err = _run([sys.executable, *BENCH, *argv], tmp_path, timeout=60)
        assert rc == 2, out + err
        runs.append(err)
    for err in runs:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], err
        assert lines[0].startswith(f"python -m dbo.bench {argv[0]}: "), err
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


def test_bad_input_under_torchrun_is_rank_0s_line(tmp_path):
    # torchrun's two ranks, forked from a process that has imported torch (dbo.testing.launch);
    # what torchrun itself reports of a rank that exits 2: tests/test_cli.py
    run = run_entry([*BENCH, "hf-prefill", "--checkpoint", "/nonexistent"], nproc=2, cwd=tmp_path,
                    env=_env(), timeout=90)
    err = run.stderr
    assert run.returncode != 0, run.stdout + err
    line = "python -m dbo.bench hf-prefill: --checkpoint /nonexistent: no such directory"
    assert err.count(line) == 1, err  # rank 0's, before any process group
    # rank 0 exits 2; the launcher then stops rank 1 (SIGTERM), as torchrun's agent does, which
    # found the same and waits to be stopped silent (or, slower than rank 0 by the whole grace,
    # exits 2 itself); none waits for a peer
    codes = run.returncodes
    assert len(codes) == 2 and 2 in codes and set(codes) <= {2, -15}, (codes, err)
    assert "Traceback" not in err and "dbo/" not in err.replace("-m dbo.bench", ""), err  # no traceback


def test_hf_generate_under_dbo_disable_marks_its_dbo_rows_and_speaks_once(tmp_path):
    out_json = tmp_path / "generate.json"
    run = run_entry([*BENCH, "hf-generate", "--backend", "all2all", "--no-static", "--steps", "1",
                     "--warmup", "0", "--json", str(out_json)], nproc=2, cwd=tmp_path,
                    env={**_env(), "DBO_DISABLE": "1"}, timeout=150)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "DBO_DISABLE=1: DBO was disabled in this run" in out, out
    rows = [ln for ln in out.splitlines() if ln.startswith("| dbo greedy_generate")]
    dbo_rows = [ln for ln in rows if "DBO" in ln.split("|")[1]]
    assert dbo_rows and all("(ran plain: DBO_DISABLE=1)" in ln for ln in dbo_rows), out
    assert "\n  ms: one greedy decode, prefill included (median); " in out, out  # the columns
    assert not any("ran plain" in ln for ln in rows if ln not in dbo_rows), out  # the plain rows are plain
    last = out.strip().splitlines()[-1]
    assert last.startswith("hf-generate: PASS: DBO_DISABLE=1: DBO was disabled"), out
    assert json.loads(out_json.read_text())["dbo_disabled"] is True
    # rank 0 speaks for the group: every row and line once, the loading bars of its loads only
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("|---")]
    assert [ln for ln, n in Counter(lines).items() if n > 1] == [], out
    loads = sum(ln.startswith("load (") for ln in lines)
    assert loads >= 1 and run.stderr.count("Loading weights: 100%") == loads, run.stderr


def test_example_under_dbo_disable_says_nothing_was_overlapped(tmp_path):
    env_run = run_entry([str(ROOT / "examples" / "hf_expert_parallel.py")], cwd=tmp_path,
                        env={**_env(), "DBO_DISABLE": "1"}, timeout=150)
    last = env_run.stdout.strip().splitlines()[-1]
    assert env_run.returncode == 0, env_run.stdout + env_run.stderr
    assert last.startswith("hf_expert_parallel.py: PASS: nothing was overlapped (disabled: DBO_DISABLE "
                           "is set): both runs were plain"), last


def test_hf_prefill_help_names_the_real_defaults():
    from dbo.backends import cpu_backends

    rc, out, err = _ranks([*BENCH, "hf-prefill", "--help"], ROOT, timeout=60, nproc=None)
    assert rc == 0, err
    assert f"default: {' '.join(cpu_backends())} on CPU" in " ".join(out.split()), out


def test_hf_generate_help_states_the_checkpoint_default(capsys):
    from dbo.bench.hf.generate import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("(default: on CPU, --preset written with random weights to a temporary directory, removed "
            "at the end; on CUDA, give --checkpoint or --save-checkpoint)") in text, text


def test_prefill_verdict_names_the_rows_that_differ():
    import torch

    from dbo.bench.hf.prefill_table import logits_match, verdict_reason

    assert logits_match(1e-4, 0.0, torch.float32) and not logits_match(2e-4, 1.0, torch.float32)
    # bf16: a broken split gives rel err ~1 and no agreement; rounding gives one or the other
    assert logits_match(0.5, 0.8, torch.bfloat16) and logits_match(0.05, 0.1, torch.bfloat16)
    assert not logits_match(0.9, 0.1, torch.bfloat16)
    good = dict(backend="naive", batch=4, seq=8, plain_ms=1.0, dbo_ms=1.0, rel_err=1e-7, top1_agree=1.0,
                ok=True, split="split(2)")
    bad = dict(good, backend="all2all", rel_err=0.9, top1_agree=0.1, ok=False)
    ok, why = verdict_reason([good, bad], "out.json")
    assert not ok and why == ("logits differ on 1 of 2 rows: all2all 4x8 (rel err 9.0e-01, top-1 agree "
                              "0.10); wrote out.json"), why
    ok, why = verdict_reason([good], None)
    assert ok and why == "DBO matches plain on every row (max rel err 1.0e-07)", why


def test_a_refused_static_cache_row_says_how(monkeypatch):
    # transformers' fast path that fails with expert parallelism is a row with the error, not a
    # failed benchmark: every rank reports it, and the speed-up is against the eager row
    from dbo.bench.hf import generate as hg
    from dbo.bench.hf.generate_table import fastest_generate_ms

    class Refusing:
        def generate(self, **kw):
            if kw.get("cache_implementation") == "static":
                raise RuntimeError("static cache: not with expert parallelism\nmore detail")
            return torch.zeros(2, 5, dtype=torch.long)

    monkeypatch.setattr(hg, "load_hf_all_to_all", lambda *a, **k: Refusing())
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: one rank is refused
    args = hg.parse_args(["--steps", "1", "--warmup", "0"])
    ids, mask, cpu = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.device("cpu")
    out = hg.transformers_generate(args, ids, mask, cpu)
    assert out["static"] == "RuntimeError: static cache: not with expert parallelism"
    assert isinstance(out["eager"], tuple) and out["eager"][2].shape == (2, 5)
    rows = [dict(run="a", mode="hf-eager", ms=5.0), dict(run="b", mode="hf-static", error="x"),
            dict(run="c", mode="plain", ms=2.0)]
    assert fastest_generate_ms(rows) == 5.0
    args = hg.parse_args(["--no-static"])
    assert "static" not in hg.transformers_generate(args, ids, mask, cpu)
