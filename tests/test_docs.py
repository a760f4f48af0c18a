"""The README and docs/ stay true to the code: every ``import`` they show runs, every file path
they name exists (``dbo/ubatch/sm.py``, or a script by its name: ``driver.py``), every dotted
name they give (``dbo.peers.watchdog.WATCHDOG``) resolves, every ``python -m dbo.bench``
command they show is one the benchmarks know, and every step of ``tests/gpu/run.sh`` they name
is one the runner knows."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from dbo.bench.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: paths of other projects that the docs cite (vLLM's design page and ubatching, SGLang's TBO)
EXTERNAL = {"docs/design/dbo.md", "vllm/v1/worker/ubatch_utils.py", "python/sglang/srt/two_batch_overlap.py"}
TOPS = "dbo|backends|tests|tools|examples|docs|\\.ci"
#: the folders a script named without its folder is looked for in
SEARCHED = ("dbo", "backends", "tests", "tools", "examples", ".ci")
#: the folder tools/offline_wheels.sh fills; the docs name the scripts it writes there
WHEELS = ".whl/"


def _imports(text: str) -> list[str]:
    # `from dbo... import a, b` or `import dbo...`, on one line or with a parenthesised list
    pattern = r"^\s*(from dbo[\w.]* import \([^)]*\)|from dbo[\w.]* import [\w, ]+|import dbo[\w.]*)"
    found = re.findall(pattern, text, re.M)
    return [re.sub(r"\s+", " ", s.strip()).rstrip(",") for s in found]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_import_shown_runs(page):
    for stmt in _imports(page.read_text()):
        exec(stmt, {})  # raises ImportError if a name or module moved


def _paths(text: str) -> set[str]:
    return {m.rstrip(".,:;)") for m in re.findall(rf"(?<![\w/.-])(?:{TOPS})/[\w./-]*\w", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_named_exists(page):
    missing = []
    for p in sorted(_paths(page.read_text())):
        if "*" in p or "<" in p or p in EXTERNAL or re.search(r"/[A-Z_]+(\.|$)", p):
            continue  # a pattern, another project's path or a placeholder (tests/gpu/NAME)
        if not (ROOT / p).exists() and not list(ROOT.glob(p + "*")):
            missing.append(p)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def _script_names(text: str) -> set[str]:
    # `driver.py`, `moe/base.py`, `.whl/prelude.sh`: a script named without a top folder; one
    # followed by a commit, `probe_balanced.py` (78e474c), was deleted there and is not looked for
    found = re.findall(r"`([\w./-]+\.(?:py|sh))`(?! \([0-9a-f]{7,40}\))", text)
    return {n for n in found if not re.match(rf"(?:{TOPS})/", n)}


def _in_repository(name: str) -> bool:
    base = name.split("/")[-1]
    return any(p.as_posix().endswith("/" + name) for top in SEARCHED for p in (ROOT / top).rglob(base))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_script_named_exists(page):
    written = (ROOT / "tools/offline_wheels.sh").read_text()
    missing = []
    for name in sorted(_script_names(page.read_text())):
        if name in EXTERNAL:
            continue
        if name.startswith(WHEELS):
            if f'"$out/{name[len(WHEELS):]}"' not in written:
                missing.append(name)  # not one of the files tools/offline_wheels.sh writes
        elif not _in_repository(name):
            missing.append(name)
    assert not missing, f"{page.name} names scripts that exist nowhere in the repository: {missing}"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute reached from the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue  # not a module: an attribute of a shorter prefix, or a wrong name
            raise  # the module exists and an optional dependency is missing: say so
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_dotted_name_resolves(page):
    names = set(re.findall(r"`(dbo(?:\.\w+)+)(?![\w<])", page.read_text()))  # `dbo.ub<i>`: a pattern
    unresolved = sorted(n for n in names if not _resolves(n))
    assert not unresolved, f"{page.name} names modules or attributes that do not exist: {unresolved}"


def test_every_bench_command_shown_is_known():
    shown = 0
    for page in PAGES:
        for commands in re.findall(r"-m dbo\.bench ([a-z][\w|-]*)", page.read_text()):
            unknown = [c for c in commands.split("|") if c not in COMMANDS]
            assert not unknown, f"{page.name}: unknown dbo.bench commands {unknown} (known: {list(COMMANDS)})"
            shown += 1
    assert shown >= 5, "the docs should show how to run the benchmarks"


def test_every_runner_step_named_is_known():
    runner = (ROOT / "tests/gpu/run.sh").read_text()
    known = set(re.findall(r"^    ([a-z_]+)\)$", runner, re.M))
    assert {"core", "experts", "deepep", "copy_engine", "faults", "overlap", "hf"} <= known
    named = 0
    call = r"tests/gpu/run\.sh((?: +(?:-[od] +\S+|[a-z_]+(?::\w+)?))+)"
    for page in PAGES:
        for args in re.findall(call, page.read_text()):
            words = args.split()
            steps = [w.split(":")[0] for k, w in enumerate(words)
                     if not w.startswith("-") and not (k and words[k - 1] in ("-o", "-d"))]
            unknown = [s for s in steps if s not in known]
            assert not unknown, f"{page.name}: unknown run.sh steps {unknown}"
            named += len(steps)
    assert named >= 5, "the docs should show how to run the GPU steps"


def test_the_pages_show_imports():
    assert sum(len(_imports(p.read_text())) for p in PAGES) >= 10


def test_the_cpu_install_line_is_pytorchs_and_the_ci_follows_it():
    # PyTorch's CPU wheel index, as PyTorch documents it for a machine without CUDA (a plain
    # `torch` from PyPI is the CUDA build); .ci/run asks the same index for the same pin, and
    # falls back to the plain pin only where that index cannot be reached
    line = re.search(r"^pip install torch==(\S+) --index-url (\S+)", (ROOT / "README.md").read_text(), re.M)
    assert line, "the README's first install line takes torch from PyTorch's CPU wheel index"
    pin, index = line.groups()
    assert index == "https://download.pytorch.org/whl/cpu"
    ci = (ROOT / ".ci/run").read_text()
    assert f"CPU_INDEX={index}\n" in ci, ci
    assert f'pip install -q torch=={pin} --index-url "$CPU_INDEX"' in ci, ci
    assert f"pip install -q torch=={pin}\n" in ci, ci  # the fallback
