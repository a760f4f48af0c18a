"""The README and docs/ stay true to the code: every ``import`` they show runs, every file path
they name exists, and every step of ``tests/gpu/run.sh`` they name is one the runner knows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: paths of other projects that the docs cite (vLLM's design page)
EXTERNAL = {"docs/design/dbo.md"}


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
    tops = "dbo|backends|tests|tools|examples|docs|\\.ci"
    return {m.rstrip(".,:;)") for m in re.findall(rf"(?<![\w/.-])(?:{tops})/[\w./-]*\w", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_named_exists(page):
    missing = []
    for p in sorted(_paths(page.read_text())):
        if "*" in p or "<" in p or p in EXTERNAL or re.search(r"/[A-Z_]+(\.|$)", p):
            continue  # a pattern, another project's path or a placeholder (tests/gpu/NAME)
        if not (ROOT / p).exists() and not list(ROOT.glob(p + "*")):
            missing.append(p)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


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
