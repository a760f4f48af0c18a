"""Every ```python block of README.md and docs/*.md runs as written, on CPU.

A block's first line may say how it is run:

* ``# needs: WHAT`` (``# needs: cuda, deep_ep and the Qwen/Qwen3-30B-A3B checkpoint``): it needs
  what a CPU machine without downloads lacks; it is compiled, not run (skipped, WHAT the reason).
* ``# fragment: ...`` naming a file of the repository (``examples/moe_overlap.py``): a part of a
  program whose other parts are the reader's; the named file is the whole version, and must
  exist. Compiled, not run.
* ``# continues the snippet above`` (or ``snippets``): it runs after the page's block before it,
  in the same program (skipped with it, if that one is).

Every other block is a whole program. A program that calls ``init_process_group`` runs as two
gloo ranks with the environment torchrun gives them, the text's ``torchrun --nproc-per-node 2``;
any other as ``python FILE``; both from a fresh folder, through
:func:`dbo.testing.launch.run_entry`. It passes when every process exits 0. A program that
defines ``test_*`` functions is a test file the docs show: it is imported here, from its folder,
and its tests are called, as pytest would (its ``DistWorld`` then forks from the server this
process has started, in a second instead of the ten a fresh process takes to start one).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from dbo.testing.launch import run_entry

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Program:
    """One or more consecutive blocks of a page, run as one file."""

    page: str
    line: int  # of the first block's first line of code
    code: str
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block, ``line`` the 1-based line of its first line."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = lines[i].lstrip()
        if fence.startswith("```python"):
            indent = len(lines[i]) - len(fence)
            j = i + 1
            while not lines[j].lstrip().startswith("```"):
                j += 1
            body = "\n".join(line[indent:] for line in lines[i + 1:j])
            found.append((i + 2, textwrap.dedent(body) + "\n"))
            i = j
        i += 1
    return found


def _programs(page: Path) -> list[Program]:
    programs: list[Program] = []
    for line, code in _blocks(page.read_text()):
        first = code.splitlines()[0].strip() if code.strip() else ""
        if re.match(r"# continues the snippets? above", first):
            assert programs, f"{page.name}:{line}: continues a snippet, but none comes before it"
            programs[-1].code += "\n" + code
            continue
        skip = None
        if first.startswith("# needs:"):
            skip = "needs " + first.removeprefix("# needs:").strip()
        elif first.startswith("# fragment:"):
            named = re.findall(r"\b((?:examples|backends|dbo|tests|tools)/[\w/.-]*\.py)\b", first)
            assert named, f"{page.name}:{line}: a fragment names no file that holds its whole version"
            missing = [p for p in named if not (ROOT / p).exists()]
            assert not missing, f"{page.name}:{line}: the fragment's whole version {missing} does not exist"
            skip = "a fragment: " + first.removeprefix("# fragment:").strip()
        programs.append(Program(page.name, line, code, skip))
    return programs


PROGRAMS = [p for page in PAGES for p in _programs(page)]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.id)
def test_snippet_runs_as_written(program, tmp_path):
    code = compile(program.code, program.id, "exec")  # a skipped one still parses
    if program.skip:
        pytest.skip(program.skip)
    path = tmp_path / ("snippet_" + re.sub(r"\W", "_", program.id) + ".py")
    path.write_text(program.code)
    if any(name.startswith("test_") for name in code.co_names):
        _run_tests_of(path)
        return
    ranks = 2 if "init_process_group" in program.code else None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DBO_DISABLE"):
        env.pop(var, None)
    run = run_entry([str(path)], nproc=ranks, cwd=tmp_path, env=env, timeout=100)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{program.id} ({ranks or 1} process(es)) exited {run.returncodes}:\n{out}"


def _run_tests_of(path: Path) -> None:
    """Import ``path`` as a module (its folder on ``sys.path``, so that processes this one
    starts import it by name too) and call its ``test_*`` functions in order."""
    sys.path.insert(0, str(path.parent))
    try:
        module = importlib.import_module(path.stem)
        for name, test in vars(module).items():
            if name.startswith("test_") and callable(test):
                test()
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(path.stem, None)


def test_most_snippets_run():
    # a marker is for what cannot run here, not a way around a snippet that fails
    ran = [p.id for p in PROGRAMS if p.skip is None]
    assert len(ran) >= 5, ran
    fragments = [p.id for p in PROGRAMS
                 if p.page == "README.md" and p.skip and not p.skip.startswith("needs")]
    assert not fragments, f"the README's snippets are whole programs: {fragments}"
