"""The fake ``deep_ep`` modules form a tree: a shared core, one module per mode, the facade on top.

The import graph is read with ``ast`` (function-level imports included, so a lazy import that
closes a circle is caught too), and each module is imported first in a fresh interpreter: a fork
of one interpreter that has imported torch and nothing of dbo (a circle among dbo's modules shows
there as in ``python -c``, without the seconds of importing torch once per module).
"""

from __future__ import annotations

import ast
import json
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


#: forks one child per module named in argv; each imports it first and prints the first name of
#: its ``__all__``; answers ``{name: [returncode, stdout, stderr]}`` as JSON
FORK_IMPORTS = """
import json
import os
import sys
import tempfile
import torch
assert not any(m == "dbo" or m.startswith("dbo.") for m in sys.modules), "dbo imported before the fork"
results = {}
with tempfile.TemporaryDirectory() as tmp:
    for name in sys.argv[1:]:
        out, err = (os.path.join(tmp, name + ext) for ext in (".out", ".err"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, path in ((1, out), (2, err)):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                m = __import__("dbo.testing." + name, fromlist=["__all__"])
                print(sorted(m.__all__)[0])
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        results[name] = [code, open(out).read(), open(err).read()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, tuple[int, str, str]]:
    """``(returncode, stdout, stderr)`` of importing each fake module first in a fresh
    interpreter (forked from one that has imported torch alone)."""
    proc = subprocess.run([sys.executable, "-c", FORK_IMPORTS, *FAKES], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {name: tuple(r) for name, r in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("name", FAKES)
def test_fake_module_imports_first_in_a_fresh_interpreter(name, fresh_imports):
    returncode, stdout, stderr = fresh_imports[name]
    assert returncode == 0 and stdout.strip(), stderr
