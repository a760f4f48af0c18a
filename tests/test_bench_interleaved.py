"""dbo.bench.hf.generate.interleaved_ms: the rows of one backend are timed call by call in an
order that rotates and turns round, so no row always runs first or after the same one."""

from __future__ import annotations

import pytest
import torch

from dbo.bench.hf.generate import interleaved_ms


def test_rounds_rotate_and_alternate_direction():
    seen: list[str] = []
    calls = {n: (lambda n=n: seen.append(n) or n.upper()) for n in ("a", "b", "c")}
    times, last = interleaved_ms(calls, rounds=4, warmup=1, device=torch.device("cpu"))
    assert seen[:3] == ["a", "b", "c"]  # the warm-up round
    rounds = [seen[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert rounds == [["a", "b", "c"], ["a", "c", "b"], ["c", "a", "b"], ["c", "b", "a"]]
    assert {r[0] for r in rounds} == {"a", "c"} and {r[-1] for r in rounds} == {"a", "b", "c"}
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(v >= 0 for t in times.values() for v in t)
    assert last == {"a": "A", "b": "B", "c": "C"}


def test_every_call_goes_first_within_as_many_rounds_as_calls_times_two():
    seen: list[str] = []
    names = ["p", "q", "r"]
    interleaved_ms({n: (lambda n=n: seen.append(n)) for n in names}, rounds=6, warmup=0,
                   device=torch.device("cpu"))
    firsts = [seen[3 * r] for r in range(6)]
    assert set(firsts) == set(names)


def test_modes_choose_the_rows_and_need_plain(capsys, monkeypatch):
    from dbo.bench.hf.generate import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: one rank is refused

    assert parse_args(["--modes", "plain", "dbo-prefill"]).modes == ["plain", "dbo-prefill"]
    assert parse_args([]).modes == ["plain", "dbo-prefill", "dbo"]
    with pytest.raises(SystemExit) as e:
        parse_args(["--modes", "dbo-prefill", "dbo"])
    assert e.value.code == 2
    assert "--modes: give plain too" in capsys.readouterr().err


def test_teacher_forced_share_checks_every_decode_step():
    # greedy tokens of the model itself are all its forward's choices; a decode step that went
    # wrong (here: every new token after the first replaced, as a stale cache or a wrong
    # position would) is caught, which the first new token alone would not show
    pytest.importorskip("transformers")
    from dbo.bench.hf.generate import teacher_forced_share
    from dbo.integrations.transformers.presets import tiny_random_model

    model = tiny_random_model("qwen3_moe", 0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (4, 8), generator=g)
    with torch.inference_mode():
        seqs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
        assert teacher_forced_share(model, seqs, prompt=8) == 1.0
        assert teacher_forced_share(model, seqs, prompt=8, max_tokens=30) == 1.0  # 2 a forward
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # a left-padded prompt: positions follow the mask, as in generate()
        padded = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                                min_new_tokens=6, pad_token_id=0)
        assert teacher_forced_share(model, padded, prompt=8, attention_mask=mask) == 1.0
        wrong = seqs.clone()
        wrong[:, 9:] = (wrong[:, 9:] + 1 + torch.arange(5)) % model.config.vocab_size
        assert teacher_forced_share(model, wrong, prompt=8) <= 0.5
