"""A transformers MoE model as one rank of an emulated expert-parallel group, on CPU: converted
over an :class:`~dbo.backends.emulated.EmulatedGroup` (no process group), it holds that rank's
experts, prefills through the emulated backend in DeepEP's high-throughput layout and decodes
through its low-latency layout inside ``decode_phase``; ``DBOPrefill`` and ``greedy_generate``
(with and without ``cuda_graph``) give the plain run's output, which is that of the whole model
with the stand-in routing (token ``t`` to experts ``r * L + ids[t] % L``). Then the entry points,
``python -m dbo.bench hf-prefill|hf-generate --emulate-ep N``, as plain python."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dbo.backends.emulated import EmulatedGroup  # noqa: E402
from dbo.bench.hf.model import build_model  # noqa: E402
from dbo.experts import relative_error  # noqa: E402
from dbo.integrations.transformers import (  # noqa: E402
    DBOPrefill,
    convert_to_expert_parallel,
    find_moe_blocks,
    prefill_logits,
    prefill_split_config,
    use_backend,
)
from dbo.integrations.transformers.generate import greedy_generate  # noqa: E402
from dbo.integrations.transformers.moe_block import ExpertParallelMoE  # noqa: E402
from dbo.integrations.transformers.presets import tiny_config  # noqa: E402
from dbo.split import SplitConfig  # noqa: E402

pytestmark = pytest.mark.timeout(180)

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def _emulated(family: str, group: EmulatedGroup, *, max_tokens: int, decode_tokens: int | None = None,
              layers: int = 2) -> torch.nn.Module:
    """The tiny ``family`` model as ``group``'s rank: the prefill in the high-throughput layout,
    and (``decode_tokens``) the decode steps in the low-latency one."""
    model = build_model(f"tiny-{family}", tiny_config(family, layers=layers), BF16, CPU, seed=3,
                        convert=True, group=group)
    decode = {} if decode_tokens is None else dict(
        decode_backend="emulated", decode_backend_kwargs=dict(layout="deepep_ll",
                                                              max_tokens_per_rank=decode_tokens))
    return use_backend(model, "emulated", layout="deepep_ht", max_tokens_per_rank=max_tokens, **decode)


def _stand_in_reference(family: str, group: EmulatedGroup, layers: int = 2) -> torch.nn.Module:
    """The whole model (every expert, same weights) whose routers send each (token, expert) pair
    to the expert that stands in for it on ``group``'s rank: ``r * L + id % L``."""
    model = build_model(f"tiny-{family}", tiny_config(family, layers=layers), BF16, CPU, seed=3,
                        convert=False)
    for _, block, fam in find_moe_blocks(model):
        experts = getattr(block, fam.experts_attr).gate_up_proj.shape[0]
        local = experts // group.size()

        def remap(module, args, out, local=local):
            logits, weights, ids = out
            return logits, weights, group.rank() * local + ids % local

        getattr(block, fam.router_attr).register_forward_hook(remap)
    return model


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, group", [("qwen3_moe", EmulatedGroup(4, 1)),
                                           ("deepseek_v3", EmulatedGroup(4, 3, gpus_per_host=2)),
                                           ("mixtral", EmulatedGroup(2, 0))],
                         ids=["qwen3_moe-r1of4", "deepseek_v3-r3of4", "mixtral-r0of2"])
def test_prefill_as_one_rank_matches_the_stand_in_reference(family, group):
    model = _emulated(family, group, max_tokens=5 * 7)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    local = 8 // group.size()
    assert blocks and all(b.expert_range == (group.rank() * local, (group.rank() + 1) * local)
                          for b in blocks)
    assert all(b.w1.shape[0] == local for b in blocks)  # the rank's experts only
    assert {b.kernel.prepare_finalize.name for b in blocks} == {"emulated:deepep_ht"}
    ids = _ids(5, 7)
    with torch.inference_mode():
        plain = prefill_logits(model, ids)
        split = DBOPrefill(model, prefill_split_config(adaptive=False))
        dbo = split(ids)
        assert split.last_plan.split
        merged = DBOPrefill(model, prefill_split_config(adaptive=False, expert_schedule="merged"))(ids)
        want = prefill_logits(_stand_in_reference(family, group), ids)
    assert relative_error(dbo, plain) <= 1e-2
    assert relative_error(merged, plain) <= 1e-2
    # bf16: the reference's experts sum in another order
    assert relative_error(plain, want) <= 3e-2, relative_error(plain, want)
    assert (plain[:, -1].argmax(-1) == want[:, -1].argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_decode_runs_the_low_latency_layout_and_generates_as_plain(family):
    group = EmulatedGroup(4, 2, gpus_per_host=2)
    batch, prompt, new = 4, 6, 4
    model = _emulated(family, group, max_tokens=batch * prompt, decode_tokens=batch)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    calls = {"emulated:deepep_ht": 0, "emulated:deepep_ll": 0}

    def counted(pf, method):
        inner = getattr(pf, method)

        def spy(*args, **kwargs):
            calls[pf.name] += 1
            return inner(*args, **kwargs)

        setattr(pf, method, spy)

    for b in blocks:
        for kernel in (b.kernel, b.decode_kernel):
            counted(kernel.prepare_finalize, "prepare")
            counted(kernel.prepare_finalize, "prepare_async")
    ids = _ids(batch, prompt, seed=1)
    runs = {}
    with torch.inference_mode():
        runs["plain"], _ = greedy_generate(model, ids, max_new_tokens=new, config=SplitConfig(enabled=False))
        ht_per_call = calls["emulated:deepep_ht"]
        assert ht_per_call == len(blocks)  # the prompt went through the high-throughput layout
        assert calls["emulated:deepep_ll"] == len(blocks) * (new - 1)  # each decode step, low-latency
        runs["dbo prefill"], plan = greedy_generate(model, ids, max_new_tokens=new)
        assert plan.split
        runs["dbo"], _ = greedy_generate(model, ids, max_new_tokens=new, split_decode=True)
        runs["graph"], _ = greedy_generate(model, ids, max_new_tokens=new, config=SplitConfig(enabled=False),
                                           cuda_graph=True)  # on the CPU: the static-cache steps, eager
        runs["dbo prefill, graph"], _ = greedy_generate(model, ids, max_new_tokens=new, cuda_graph=True)
        runs["dbo, graph"], _ = greedy_generate(model, ids, max_new_tokens=new, split_decode=True,
                                                cuda_graph=True)
        # the overlapped steps with SMs carved out for the communication (on the CPU: no SMs)
        runs["dbo, 8 SMs free"], _ = greedy_generate(model, ids, max_new_tokens=new, split_decode=True,
                                                     sm_carveout=8)
    for name, tokens in runs.items():
        assert torch.equal(tokens, runs["plain"]), name
    with torch.inference_mode():  # the plain decode's steps are the whole model's choices
        want = prefill_logits(_stand_in_reference(family, group), runs["plain"][:, :-1],
                              logits_to_keep=new)
    agree = (want.argmax(-1) == runs["plain"][:, prompt:]).float().mean()
    assert agree >= 0.75, agree


def test_an_emulated_group_runs_the_emulated_backend_only():
    model = build_model("tiny-qwen3_moe", tiny_config("qwen3_moe"), BF16, CPU, seed=0, convert=False)
    with pytest.raises(ValueError, match="runs the emulated backend"):
        convert_to_expert_parallel(model, EmulatedGroup(4, 0), "all2all")
    with pytest.raises(ValueError, match=r"group=EmulatedGroup\(N, rank\)"):
        convert_to_expert_parallel(model, None, "emulated", layout="deepep_ht", max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over 3 ranks"):
        convert_to_expert_parallel(model, EmulatedGroup(3, 0), "emulated", layout="deepep_ht",
                                   max_tokens_per_rank=8)
    converted = _emulated("qwen3_moe", EmulatedGroup(4, 1), max_tokens=8)
    with pytest.raises(ValueError, match="ep_size=8: the model holds the experts of rank 1 of 4"):
        use_backend(converted, "emulated", layout="deepep_ht", max_tokens_per_rank=8, ep_size=8)
    with pytest.raises(ValueError, match="runs the emulated backend"):
        use_backend(converted, "naive")


# ---- the entry points, as plain python --------------------------------------------------------

BENCH = ["-m", "dbo.bench"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DBO_DISABLE", "WORLD_SIZE", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(argv: list[str], cwd: Path):
    from dbo.testing.launch import run_entry

    run = run_entry([*BENCH, *argv], nproc=None, cwd=cwd, env=_env(), timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.multiproc
def test_hf_prefill_as_one_emulated_rank(tmp_path):
    out = _run(["hf-prefill", "--emulate-ep", "4", "--emulate-rank", "1", "--gpus-per-host", "2",
                "--link", "50,5", "--shape", "4x8", "--steps", "1", "--warmup", "0",
                "--expert-schedule", "split", "merged", "--json", "p.json"], tmp_path)
    assert "one CPU as the emulated rank 1 of EP4 (2 GPUs a host: 0.500 of its bytes leave the host" in out
    assert out.strip().splitlines()[-1].startswith("hf-prefill: PASS: DBO matches plain on every row"), out
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["emulated"] == {"ep_size": 4, "rank": 1, "gpus_per_host": 2, "remote_fraction": None,
                                  "link": "50,5"}
    assert [r["backend"] for r in record["rows"]] == ["emulated deepep_ht/split", "emulated deepep_ht/merged"]
    assert all(r["ok"] and r["split"].startswith("split(") for r in record["rows"]), record["rows"]


@pytest.mark.multiproc
def test_hf_generate_as_one_emulated_rank(tmp_path):
    out = _run(["hf-generate", "--emulate-ep", "4", "--emulate-rank", "3", "--link", "50,5",
                "--batch", "4", "--prompt", "6", "--new-tokens", "3", "--steps", "1", "--warmup", "0",
                "--modes", "plain", "dbo-prefill", "dbo", "graph", "--sm-carveout", "4", "--json", "g.json"],
               tmp_path)
    assert out.strip().splitlines()[-1].startswith("hf-generate: PASS: every DBO run's first new token"), out
    assert "fastest overlapped run: " in out
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["emulated"]["ep_size"] == 4 and record["emulated"]["rank"] == 3
    assert record["sm_carveout"] == 4 and "the overlapped steps leave 4 SMs free" in out
    rows = record["rows"]
    # under a link, the fastest plain mode again with the link off: the compute alone, for the bound
    assert [r["mode"] for r in rows] == ["plain", "DBO prefill", "DBO", "plain, graph decode",
                                         "compute alone"]
    assert all(r["run"].startswith("dbo greedy_generate emulated deepep_ht/deepep_ll") for r in rows)
    assert all(r["same_plain"] == 1.0 for r in rows[:-1]), rows
    alone = rows[-1]
    assert alone["same"] == 1.0 and alone["run"].endswith(", link off"), alone
    bound = next(line for line in out.splitlines() if line.startswith("bound: "))
    plain = min((r for r in rows if r["mode"] in ("plain", "plain, graph decode")), key=lambda r: r["ms"])
    comm = max(0.0, plain["ms"] - alone["ms"])
    assert f"= {plain['ms'] / max(alone['ms'], comm):.2f}x" in bound and plain["run"] in bound, bound


BAD = [
    (["hf-prefill", "--emulate-ep", "3"], "--emulate-ep 3: tiny-qwen3_moe's 8 routed experts do not "
                                          "split evenly over 3 ranks"),
    (["hf-prefill", "--emulate-ep", "1"], "--emulate-ep 1: an expert-parallel group has at least 2 ranks"),
    (["hf-prefill", "--emulate-ep", "4", "--emulate-rank", "4"], "--emulate-rank 4: must be in [0, 4)"),
    (["hf-prefill", "--emulate-ep", "16", "--gpus-per-host", "3", "--preset", "qwen3-30b-a3b", "--layers",
      "1"], "--gpus-per-host 3: must be >= 1 and divide --emulate-ep 16"),
    (["hf-prefill", "--emulate-ep", "4", "--backend", "all2all"], "--backend all2all with --emulate-ep"),
    (["hf-prefill", "--emulate-ep", "4", "--dtype", "float32"],
     "--dtype float32 with --emulate-ep 4: an emulated rank moves bfloat16"),
    (["hf-prefill", "--emulate-ep", "4", "--unconverted"], "--unconverted with --emulate-ep 4"),
    (["hf-prefill", "--emulate-ep", "4", "--save-checkpoint", "ckpt"],
     "--save-checkpoint with --emulate-ep 4: an emulated rank builds --preset"),
    (["hf-generate", "--emulate-ep", "4", "--backend", "deepep_ht/deepep_ll"],
     "--backend deepep_ht with --emulate-ep"),
    (["hf-generate", "--emulate-ep", "5"], "--emulate-ep 5: tiny-qwen3_moe's 8 routed experts"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_emulation_is_one_line(tmp_path, monkeypatch, capsys, argv, message):
    from dbo.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"python -m dbo.bench {argv[0]}: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["hf-prefill", "hf-generate"])
def test_emulation_under_torchrun_is_refused(monkeypatch, capsys, command):
    from dbo.bench.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        main([command, "--emulate-ep", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "--emulate-ep 4 under a group of 2 ranks: run it as plain python" in err[0], err
