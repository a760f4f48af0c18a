"""greedy_generate(cuda_graph=True): the decode steps from a static KV cache (replayed from a
CUDA graph on GPUs; on the CPU the same steps run eagerly). Here: the same tokens as the plain
decode on 2 gloo ranks, after a plain and an overlapped prefill, with left padding; no host sync
inside a static step outside the MoE layers (what a capture forbids; the capturable backends'
own layers are checked by the GPU benchmark's captures); the arguments' checks.

``DBO_TEST_DIST_BACKEND=nccl`` (``bash tests/gpu/run.sh hfgraph``) runs the two-rank case on 2
GPUs, a rank each, with the capturable backends (``copy_engine``; ``deepep``, high-throughput
prefill and low-latency decode, where ``deep_ep`` imports): the steps captured and replayed give
the eager plain decode's tokens (float32), or, in bf16 for DeepEP, tokens that one plain forward
over the sequences also picks (near ties aside)."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import warnings

import pytest
import torch

from dbo.testing.dist import DistWorld

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("transformers.distributed.expert_parallel",
                    reason="transformers < 5.23 has no EP implementation interface")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dbo.integrations.transformers import graph_decode  # noqa: E402
from dbo.integrations.transformers.generate import greedy_generate  # noqa: E402
from dbo.split import SplitConfig  # noqa: E402

PLAIN = SplitConfig(enabled=False)
SPLIT = SplitConfig(prefill_token_threshold=2, decode_token_threshold=2)


def _tiny_moe():
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    torch.manual_seed(0)
    return causal_lm_class("qwen3_moe")(tiny_config("qwen3_moe")).eval()


#: ``nccl``: the two-rank case on 2 GPUs (captured steps); default gloo (eager static steps)
BACKEND = os.environ.get("DBO_TEST_DIST_BACKEND", "gloo")


def _ep_backends() -> list[str]:
    if BACKEND != "nccl":
        return ["all2all"]
    return ["copy_engine"] + (["deepep"] if importlib.util.find_spec("deep_ep") else [])


def _ep_job(ckpt: str, backend: str) -> list:
    from dbo.bench.hf.generate import teacher_forced_share
    from dbo.bench.hf.model import load_checkpoint
    from dbo.testing.hf import left_padded_prompts

    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if backend == "deepep" else torch.float32  # DeepEP moves bf16 only
    model = load_checkpoint(ckpt, dtype, device, backend=backend)
    ran = []
    real = graph_decode.static_decode

    def spy(*args, **kwargs):
        ran.append(kwargs.get("capture", args[-1] if args else None))
        return real(*args, **kwargs)

    import dbo.integrations.transformers.generate as generate

    generate.static_decode = spy
    out = []
    try:
        with torch.inference_mode():
            for pads, new in (((0, 2, 0, 1), 6), ((3, 0), 2), ((0, 0, 0), 1)):
                ids, mask = (t.to(device) for t in
                             left_padded_prompts(5 + rank, pads, 8, vocab=model.config.vocab_size))
                # plain; split prefill, joined decode; every decode step split (its own static
                # cache per ubatch, the captured step the overlapped one)
                for cfg, split_decode in ((PLAIN, False), (SPLIT, False), (SPLIT, True)):
                    want, _ = greedy_generate(model, ids, mask, max_new_tokens=new, config=cfg,
                                              split_decode=split_decode)
                    got, _ = greedy_generate(model, ids, mask, max_new_tokens=new, config=cfg,
                                             split_decode=split_decode, cuda_graph=True)
                    tf = teacher_forced_share(model, got, 8, attention_mask=mask)
                    out.append((len(pads), new, cfg.enabled, torch.equal(want.cpu(), got.cpu()), tf,
                                got.shape[1] - 8))
    finally:
        generate.static_decode = real
    return [out, ran]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", _ep_backends())
def test_static_decode_gives_the_plain_decodes_tokens_on_two_ranks(tmp_path, backend):
    from dbo.integrations.transformers.checkpoint import write_random_checkpoint
    from dbo.integrations.transformers.presets import tiny_config

    if BACKEND == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("DBO_TEST_DIST_BACKEND=nccl needs 2 GPUs")
    ckpt = write_random_checkpoint(tiny_config("qwen3_moe"), tmp_path / "ckpt", dtype=torch.float32, seed=3)
    with DistWorld(2, backend=BACKEND) as world:
        results = world.run(_ep_job, str(ckpt), backend, timeout_s=180)
    for out, ran in results:
        if backend == "deepep":  # bf16: near ties may go either way; each token must be a plain
            # forward's choice (dbo.bench.hf.generate.teacher_forced_share)
            assert all(tf == 1.0 for *_, tf, _ in out), out
        else:  # float32: the eager decode's tokens exactly
            assert all(same and tf == 1.0 for *_, same, tf, _ in out), out
        assert [n for *_, n in out] == [6, 6, 6, 2, 2, 2, 1, 1, 1], out
        # every call of more than one new token took the static path: captured and replayed on
        # GPUs, eagerly on the CPU
        assert ran == [BACKEND == "nccl"] * 6, ran


def _eager_and_static(model, *, seq: int, padded_row: int, pad: int, new: int):
    """The tokens of 3 prompts of ``seq`` (one left-padded by ``pad``) decoded plainly, eagerly
    and from the static cache (``cuda_graph=True``)."""
    ids = torch.randint(0, model.config.vocab_size, (3, seq))
    mask = torch.ones_like(ids)
    mask[padded_row, :pad] = 0
    with torch.inference_mode():
        want, _ = greedy_generate(model, ids, mask, max_new_tokens=new, config=PLAIN)
        got, _ = greedy_generate(model, ids, mask, max_new_tokens=new, config=PLAIN, cuda_graph=True)
    return want, got


def test_a_decode_passes_the_cache_by_the_name_the_model_takes(monkeypatch):
    # transformers 5.24 renamed past_key_values to cache (the old name warns, FutureWarning, and
    # goes in 5.40); 5.23 knows only past_key_values: greedy_generate uses the forward's own
    # name, in the prefill, the joined and the split decode steps and the static ones
    from dbo.integrations.transformers.generate import cache_keyword

    model = _tiny_moe()
    params = inspect.signature(model.forward).parameters
    assert cache_keyword(model) == ("cache" if "cache" in params else "past_key_values")
    records: list[logging.LogRecord] = []  # transformers' own log: reading out.past_key_values
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    ids = torch.randint(0, model.config.vocab_size, (4, 5))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            want, got = _eager_and_static(model, seq=5, padded_row=1, pad=2, new=3)
            with torch.inference_mode():
                joined, plan = greedy_generate(model, ids, max_new_tokens=3, config=SPLIT)
                every_step, _ = greedy_generate(model, ids, max_new_tokens=3, config=SPLIT, split_decode=True)
                plain, _ = greedy_generate(model, ids, max_new_tokens=3, config=PLAIN)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert torch.equal(want, got) and plan.split
    assert torch.equal(joined, plain) and torch.equal(every_step, plain)
    assert not [r for r in records if "past_key_values" in r.getMessage()], records


class _HostSyncs(TorchDispatchMode):
    """The ops that read a tensor's value on the host (a capture fails on them on a GPU),
    outside the MoE blocks (``inside`` counts the blocks entered)."""

    SYNCING = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item")

    def __init__(self):
        super().__init__()
        self.inside = 0
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self.inside == 0 and name in self.SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_a_static_step_reads_nothing_on_the_host_outside_the_moe_blocks(monkeypatch):
    model = _tiny_moe()
    mode = _HostSyncs()
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    assert blocks
    for b in blocks:
        b.register_forward_pre_hook(lambda *_: setattr(mode, "inside", mode.inside + 1))
        b.register_forward_hook(lambda *_: setattr(mode, "inside", mode.inside - 1))
    real = graph_decode.static_decode
    steps = []

    def watched(step, *args, **kwargs):
        def step_in_mode(*a):
            with mode:
                steps.append(1)
                return step(*a)

        return real(step_in_mode, *args, **kwargs)

    monkeypatch.setattr("dbo.integrations.transformers.generate.static_decode", watched)
    want, got = _eager_and_static(model, seq=6, padded_row=1, pad=2, new=5)
    assert torch.equal(want, got)
    assert len(steps) == 4  # the decode steps after the prefill
    assert mode.seen == [], mode.seen


@pytest.mark.parametrize("batch", [4, 5])
def test_split_decode_steps_from_a_static_cache_per_ubatch(batch, monkeypatch):
    # split_decode with cuda_graph: each ubatch its own static cache (an odd batch pads the
    # second ubatch, whose cache holds the padding row too), the same tokens as the eager split
    # decode and the plain one
    model = _tiny_moe()
    ran = []
    real = graph_decode.static_decode
    monkeypatch.setattr("dbo.integrations.transformers.generate.static_decode",
                        lambda *a, **k: ran.append(1) or real(*a, **k))
    ids = torch.randint(0, model.config.vocab_size, (batch, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.inference_mode():
        plain, _ = greedy_generate(model, ids, mask, max_new_tokens=4, config=PLAIN)
        eager, plan = greedy_generate(model, ids, mask, max_new_tokens=4, config=SPLIT, split_decode=True)
        static, _ = greedy_generate(model, ids, mask, max_new_tokens=4, config=SPLIT, split_decode=True,
                                    cuda_graph=True)
    assert plan.split and ran == [1]
    assert torch.equal(static, eager) and torch.equal(static, plain)


def test_arguments_and_caches_that_cannot_be_static():
    model = _tiny_moe()
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    assert graph_decode.static_cache_from(model, object(), 16) is None
    from transformers.cache_utils import DynamicCache

    assert graph_decode.static_cache_from(model, DynamicCache(), 16) is None  # nothing in it
    with pytest.raises(ValueError, match="need 9 slots"):
        graph_decode.static_decode(lambda *a: None, ids[:, :1], ids[:, :1], torch.ones(2, 5), 8, 5,
                                   capture=False)
    with pytest.raises(ValueError, match="sm_carveout must be a non-negative int"):  # before any step
        greedy_generate(model, ids, max_new_tokens=2, sm_carveout=-1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_every_supported_family_decodes_the_same_from_a_static_cache(family, monkeypatch):
    from dbo.integrations.transformers.presets import causal_lm_class, tiny_config

    torch.manual_seed(1)
    model = causal_lm_class(family)(tiny_config(family)).eval()
    ran = []
    real = graph_decode.static_decode
    monkeypatch.setattr("dbo.integrations.transformers.generate.static_decode",
                        lambda *a, **k: ran.append(1) or real(*a, **k))
    want, got = _eager_and_static(model, seq=5, padded_row=0, pad=3, new=6)
    assert ran == [1], f"{family}: the static path did not run"
    assert torch.equal(want, got), (want[:, 5:], got[:, 5:])


class _FakeEvent:
    """A CUDA event stand-in: done once ``done`` is set; counts its synchronizations."""

    def __init__(self, log: list):
        self.done, self.log = False, log
        log.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # (a real one waits for the GPU)
        self.log.append(("sync", self))


def test_replay_pacer_keeps_the_host_at_most_lead_replays_ahead():
    from dbo.peers.watchdog import GpuWaitWatchdog

    log: list = []
    dog = GpuWaitWatchdog(on_expire=lambda m: None)
    pacer = graph_decode.ReplayPacer(5, 0, event=lambda: _FakeEvent(log), watchdog=dog, lead=2)
    for step in range(2, 6):
        pacer.replayed(step)
    events = [e for e in log if isinstance(e, _FakeEvent)]
    synced = [e for tag, e in (x for x in log if isinstance(x, tuple))]
    assert len(events) == 4 and synced == events[:2]  # after the 3rd and 4th replay: the oldest
    pacer.drain()
    synced = [e for tag, e in (x for x in log if isinstance(x, tuple))]
    assert synced == events and all(e.done for e in events)
    dog.stop()


def test_replay_pacer_watch_names_the_stuck_step_after_the_timeout_plus_grace():
    import time

    from dbo.peers.watchdog import GpuWaitWatchdog, collective_timeout

    fired: list[str] = []
    dog = GpuWaitWatchdog(on_expire=fired.append)
    with collective_timeout(3.0):
        pacer = graph_decode.ReplayPacer(64, 1, event=lambda: _FakeEvent([]), watchdog=dog)
    assert pacer.timeout_s == 3.0 + graph_decode.REPLAY_WATCH_GRACE_S
    pacer.replayed(2)
    pacer.replayed(3)
    dog.stop()  # polled by hand below

    dog.poll(now=time.monotonic() + 1.0)  # within the deadline: nothing
    assert fired == []
    dog.poll(now=time.monotonic() + pacer.timeout_s + 0.5)
    assert len(fired) == 1
    msg = fired[0]
    assert "replayed decode step 2 of 64" in msg and "on rank 1" in msg and "4.0 s" in msg, msg
    assert "exit code 75" in msg, msg


def test_replay_pacer_default_timeout_outside_a_collective_timeout_block():
    pacer = graph_decode.ReplayPacer(4, 0, event=lambda: _FakeEvent([]))
    assert pacer.timeout_s == graph_decode.REPLAY_DEFAULT_TIMEOUT_S + graph_decode.REPLAY_WATCH_GRACE_S
    with pytest.raises(ValueError, match="lead"):
        graph_decode.ReplayPacer(4, 0, lead=0)
