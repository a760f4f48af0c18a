"""Every keyword the DeepEP backends pass exists in the real DeepEP's Python signatures.

The signatures were read from DeepEP's sources with ``ast``, never imported (fixtures in
``tests/fixtures``: v2 ``ElasticBuffer`` 2.1.0 and ``EPBuffer``; the v1 ``Buffer`` of the
tokenspeed-deepep wheel). Three checks:

* static: every ``.dispatch(...)``/``.combine(...)``/... call and buffer constructor in
  ``backends/deepep_*.py`` uses only keywords of that method (no ``**kwargs`` splats), and
  every ``handle.<attr>`` the v2 backend reads is an ``EPHandle`` attribute;
* dynamic: the backends, run serially and under DBO against the fake, are recorded calling the
  buffer: every keyword and the number of positional arguments fit every fixture version;
* the fake's own signatures equal the fixtures' (so CPU tests exercise the real interface).
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dbo import run_ubatches
from dbo.testing.fake_deep_ep import Buffer as FakeBuffer
from dbo.testing.fake_deep_ep import ensure_fake_deep_ep
from dbo.testing.fake_deep_ep_v2 import ElasticBuffer as FakeElasticBuffer
from dbo.testing.fake_deep_ep_v2 import EPBuffer as FakeEPBuffer

ROOT = Path(__file__).resolve().parents[1]
V1 = json.loads((ROOT / "tests/fixtures/deepep_v1_signatures.json").read_text())["sources"]
V2 = json.loads((ROOT / "tests/fixtures/deepep_v2_signatures.json").read_text())["sources"]

#: buffer methods the backends call -> the fixture class that defines them
V1_METHODS = {"get_dispatch_layout", "dispatch", "combine", "capture", "get_dispatch_config",
              "get_combine_config", "low_latency_dispatch", "low_latency_combine",
              "clean_low_latency_buffer", "get_low_latency_rdma_size_hint", "destroy"}
V2_METHODS = {"dispatch", "combine", "capture", "destroy"}


def _v2_class(source: dict) -> dict:
    return source["classes"].get("EPBuffer") or source["classes"]["ElasticBuffer"]


def _params(method: dict) -> tuple[set[str], int, bool]:
    """(keyword names, positional slots after self, takes **kwargs)."""
    ps = method["params"]
    static = "staticmethod" in method.get("decorators", [])
    positional = [p for p in ps if p["kind"] in ("positional_only", "positional_or_keyword")]
    if not static and positional and positional[0]["name"] == "self":
        positional = positional[1:]
    names = {p["name"] for p in ps if p["kind"] in ("positional_or_keyword", "keyword_only")} - {"self"}
    return names, len(positional), any(p["kind"] == "var_keyword" for p in ps)


def _check_call(cls: dict, where: str, method: str, nargs: int, keywords: list[str]) -> list[str]:
    if method not in cls["methods"]:
        return [f"{where}: {method} does not exist"]
    names, slots, varkw = _params(cls["methods"][method])
    bad = [] if varkw else [k for k in keywords if k not in names]
    errs = [f"{where}: {method}() has no keyword {k!r}" for k in bad]
    if nargs > slots:
        errs.append(f"{where}: {method}() takes {slots} positional arguments, got {nargs}")
    return errs


# ---- static ------------------------------------------------------------------------------


def _calls(path: Path, methods: set[str]) -> list[tuple[int, str, int, list[str | None]]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
            out.append((node.lineno, node.func.attr, len(node.args), [k.arg for k in node.keywords]))
    return out


def _constructor_calls(path: Path, names: set[str]) -> list[tuple[int, int, list[str | None]]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, len(n.args), [k.arg for k in n.keywords]) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute | ast.Name)
            and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in names]


def test_v2_backend_keywords_exist_statically():
    errs = []
    path = ROOT / "backends/deepep_v2.py"
    for source in V2:
        cls = _v2_class(source)
        tag = f"DeepEP {source['version']} {source['commit'][:8]}"
        for line, method, nargs, kws in _calls(path, V2_METHODS):
            assert None not in kws, f"deepep_v2.py:{line}: **kwargs splat hides the keywords"
            errs += _check_call(cls, f"{tag} deepep_v2.py:{line}", method, nargs, kws)
        for line, nargs, kws in _constructor_calls(ROOT / "backends/deepep/buffer.py", {"v2_cls"}):
            errs += _check_call(cls, f"{tag} deepep/buffer.py:{line}", "__init__", nargs, kws)
    assert not errs, "\n".join(errs)


def test_v2_backend_reads_only_handle_attributes_that_exist():
    tree = ast.parse((ROOT / "backends/deepep_v2.py").read_text())
    read = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "handle"}
    assert read, "the v2 backend reads no handle attribute?"
    for source in V2:
        attrs = set(source["classes"]["EPHandle"]["attributes"])
        assert read <= attrs, f"DeepEP {source['version']}: EPHandle lacks {sorted(read - attrs)}"


def test_v1_backends_keywords_exist_statically():
    cls = V1[0]["classes"]["Buffer"]
    errs = []
    for name in ("deepep_ht.py", "deepep_ll.py", "deepep/buffer.py"):
        path = ROOT / "backends" / name
        for line, method, nargs, kws in _calls(path, V1_METHODS - {"destroy"}):
            if name == "deepep/buffer.py" and method in ("dispatch", "combine"):
                continue
            assert None not in kws, f"{name}:{line}: **kwargs splat hides the keywords"
            errs += _check_call(cls, f"{name}:{line}", method, nargs, kws)
    for line, nargs, kws in _constructor_calls(ROOT / "backends/deepep/buffer.py", {"buffer_cls"}):
        errs += _check_call(cls, f"deepep/buffer.py:{line}", "__init__", nargs, kws)
    assert not errs, "\n".join(errs)


# ---- the fake's signatures ---------------------------------------------------------------


def _sig(fn) -> list[tuple[str, str, bool]]:
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional_only",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
             inspect.Parameter.VAR_POSITIONAL: "var_positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword_only",
             inspect.Parameter.VAR_KEYWORD: "var_keyword"}
    return [(p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def _fixture_sig(method: dict) -> list[tuple[str, str, bool]]:
    return [(p["name"], p["kind"], p["has_default"]) for p in method["params"]]


@pytest.mark.parametrize("fake, source, name", [
    (FakeBuffer, V1[0], "Buffer"),
    (FakeElasticBuffer, next(s for s in V2 if "ElasticBuffer" in s["classes"]), "ElasticBuffer"),
    (FakeEPBuffer, next(s for s in V2 if "EPBuffer" in s["classes"]), "EPBuffer"),
])
def test_fake_signatures_match_the_real_ones(fake, source, name):
    cls = source["classes"][name]
    methods = (V1_METHODS if name == "Buffer" else V2_METHODS) | {"__init__"}
    for method in sorted(methods):
        if method not in cls["methods"]:
            continue
        fn = getattr(fake, method)
        got = _sig(fn)
        want = _fixture_sig(cls["methods"][method])
        if "staticmethod" in cls["methods"][method]["decorators"]:
            assert isinstance(inspect.getattr_static(fake, method), staticmethod), method
        assert got == want, f"fake {name}.{method}{got} != DeepEP {source['version']}{want}"


# ---- dynamic: record what the backends pass ----------------------------------------------


class _Recorder:
    """Proxy of a buffer that logs ``(method, number of positional args, keywords)``."""

    def __init__(self, target, log):
        self._target, self._log = target, log

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            self._log.append((name, len(args), sorted(kwargs)))
            return attr(*args, **kwargs)

        return call


def _record(kind: str, api: str, options: dict) -> list:
    from dbo.experts.reference import local_expert_weights, make_expert_weights
    from dbo.experts.swiglu import SwiGLUExperts
    from dbo.moe.kernel import MoEKernel
    from dbo.moe.router import topk_route

    mod = ensure_fake_deep_ep(api)
    log: list = []
    cls_name = {"v1": "Buffer", "v2-elastic": "ElasticBuffer", "v2-ep": "EPBuffer"}[api]
    real_cls = getattr(mod, cls_name)

    class RecordingInit(real_cls):
        def __init__(self, *args, **kwargs):
            log.append(("__init__", len(args), sorted(kwargs)))
            super().__init__(*args, **kwargs)

    setattr(mod, cls_name, RecordingInit)
    from dbo.backends import deepep_ht, deepep_ll, deepep_v2
    from dbo.backends.deepep import buffer as deepep_buffer

    deepep_buffer.BUFFER_CACHE.reset()
    try:
        backend_mod = {"ht": deepep_ht, "ll": deepep_ll, "v2": deepep_v2}[kind]
        pf = backend_mod.make_prepare_finalize(dist.group.WORLD, hidden=256, max_tokens_per_rank=16,
                                               num_experts=8, topk=2, dtype=torch.bfloat16, **options)
        pf._shared.buffer = _Recorder(pf._shared.buffer, log)
        rank, world = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(16, 256, generator=g).to(torch.bfloat16)
        w, ids = topk_route(torch.randn(16, 8, generator=g), 2, ids_dtype=torch.int64)
        w1, w2 = make_expert_weights(8, 256, 32, dtype=torch.bfloat16)
        w1, w2 = local_expert_weights(w1, rank, world), local_expert_weights(w2, rank, world)
        kernel = MoEKernel(pf, SwiGLUExperts())

        def layer(s=slice(None)):
            return kernel(x[s], w1, w2, w[s], ids[s], global_num_experts=8)

        serial = layer()
        dbo = torch.cat(run_ubatches([lambda: layer(slice(0, 10)), lambda: layer(slice(10, 16))],
                                     device="cpu"))
        assert torch.equal(serial, dbo)
    finally:
        setattr(mod, cls_name, real_cls)
        deepep_buffer.BUFFER_CACHE.reset()
    return log


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, api, options", [
    ("ht", "v1", {}), ("ht", "v1", {"use_fp8_dispatch": True}), ("ll", "v1", {}),
    ("ll", "v1", {"use_fp8_dispatch": True}),
    ("v2", "v2-elastic", {"mode": "decode"}), ("v2", "v2-elastic", {"mode": "prefill"}),
    ("v2", "v2-ep", {"mode": "decode"}), ("v2", "v2-ep", {"mode": "prefill"}),
])
def test_recorded_calls_fit_the_real_signatures(world2, kind, api, options):
    log = world2.run(_record, kind, api, options)[0]
    assert any(m == "__init__" for m, _, _ in log) and any(m != "__init__" for m, _, _ in log)
    sources = V1 if api == "v1" else [s for s in V2 if ("EPBuffer" in s["classes"]) == (api == "v2-ep")]
    errs = []
    for source in sources:
        cls = source["classes"]["Buffer"] if api == "v1" else _v2_class(source)
        for method, nargs, kws in log:
            errs += _check_call(cls, f"DeepEP {source['version']}", method, nargs, kws)
    assert not errs, "\n".join(sorted(set(errs)))
