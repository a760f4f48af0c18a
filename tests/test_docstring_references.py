"""Every Sphinx-style reference to a dbo name in a docstring of the library (``:func:`dbo.x.y```,
``:class:``, ``:mod:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``) names something that
exists: a module, then attributes, where an attribute of a class may be one its methods set on
``self``."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r":(?:func|mod|class|meth|attr|data|exc|obj):`~?(dbo\.[\w.]+)`")


def _docstrings(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _set_on_self(cls: type, name: str) -> bool:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{name}\s*(?::[^=]+)?=", source) is not None


def resolves(reference: str) -> bool:
    parts = reference.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for i, name in enumerate(parts[split:]):
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif isinstance(obj, type) and not isinstance(obj, ModuleType) \
                    and i == len(parts) - split - 1:
                return _set_on_self(obj, name)
            else:
                return False
        return True
    return False


def test_docstring_references_to_dbo_names_resolve():
    files = [*ROOT.glob("dbo/**/*.py"), *ROOT.glob("backends/**/*.py")]
    seen, broken = 0, []
    for path in files:
        for doc in _docstrings(path):
            for reference in REFERENCE.findall(doc):
                seen += 1
                if not resolves(reference):
                    broken.append(f"{path.relative_to(ROOT)}: {reference}")
    assert seen > 50, f"found only {seen} references: the scan is broken"
    assert not broken, "docstrings name what does not exist:\n" + "\n".join(broken)
