"""The fake ``deep_ep`` modules form a tree: a shared core, one module per mode, the facade on top.

The import graph is read with ``ast`` (function-level imports included, so a lazy import that
closes a circle is caught too), and each module is imported first in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTING = Path(__file__).resolve().parents[1] / "dbo" / "testing"
FAKES = sorted(p.stem for p in TESTING.glob("fake_deep_ep*.py"))

#: what each fake module may import from the others
ALLOWED = {
    "fake_deep_ep_core": set(),
    "fake_deep_ep_ll": {"fake_deep_ep_core"},
    "fake_deep_ep_v2": {"fake_deep_ep_core"},
    "fake_deep_ep": {"fake_deep_ep_core", "fake_deep_ep_ll", "fake_deep_ep_v2"},
}


def _fake_imports(name: str) -> set[str]:
    tree = ast.parse((TESTING / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {m.rsplit(".", 1)[-1] for m in mods if m.rsplit(".", 1)[-1] in FAKES}
    return found - {name}


def test_every_fake_module_is_known():
    assert set(FAKES) == set(ALLOWED)


@pytest.mark.parametrize("name", FAKES)
def test_fake_imports_only_what_lies_below(name):
    assert _fake_imports(name) <= ALLOWED[name]


def test_fake_import_graph_has_no_cycle():
    graph = {name: _fake_imports(name) for name in FAKES}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for dep in graph[name]:
                visit(dep, (*path, name))
            done.add(name)

    for name in FAKES:
        visit(name, ())


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, tuple[int, str, str]]:
    """``(returncode, stdout, stderr)`` of importing each fake module first in a fresh
    interpreter; the interpreters run at once, since each spends seconds importing torch."""
    procs = {name: subprocess.Popen([sys.executable, "-c", f"import dbo.testing.{name} as m; "
                                     "print(sorted(m.__all__)[0])"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in FAKES}
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[name] = (p.returncode, stdout, stderr)
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.parametrize("name", FAKES)
def test_fake_module_imports_first_in_a_fresh_interpreter(name, fresh_imports):
    returncode, stdout, stderr = fresh_imports[name]
    assert returncode == 0 and stdout.strip(), stderr
