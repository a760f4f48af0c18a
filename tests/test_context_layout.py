"""House rule: only the context modules import greenlet (``dbo/ubatch/context.py`` and the
modules it is split into), and the public contract stays importable from ``dbo.ubatch.context``."""

from __future__ import annotations

import ast
from pathlib import Path

import dbo.ubatch.context

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_MODULES = {"dbo/ubatch/context.py", "dbo/ubatch/driver.py", "dbo/ubatch/state.py",
                   "dbo/ubatch/modes.py"}
# The switch benchmark times two bare greenlets as the floor under dbo's switch: it measures
# greenlet itself, it does not run ubatches with it.
MEASURES_GREENLET = {"dbo/bench/switch.py"}


def _imports_greenlet(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "greenlet" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "greenlet":
            return True
    return False


def test_only_context_modules_import_greenlet():
    files = [*ROOT.glob("dbo/**/*.py"), *ROOT.glob("backends/**/*.py")]
    importers = {str(p.relative_to(ROOT)) for p in files if _imports_greenlet(p)}
    assert importers, "the driver imports greenlet: the scan found nothing, so it is broken"
    outside = importers - CONTEXT_MODULES - MEASURES_GREENLET
    assert not outside, f"greenlet imported outside the context modules: {outside}"


def test_context_modules_exist():
    assert all((ROOT / m).is_file() for m in CONTEXT_MODULES)


def test_contract_names_importable_from_dbo_context():
    for name in dbo.ubatch.context.__all__:
        assert callable(getattr(dbo.ubatch.context, name)), name


def test_the_drivers_test_seam_is_public_and_documented():
    # tests/test_context_broken.py replaces these to build broken drivers; the driver's module
    # docstring names them, and they are public where they are defined
    from dbo.ubatch import driver, modes, state

    for owner, name in ((driver.Run, "make_yield"), (driver.Run, "unwind"),
                        (state.UBatchContext, "body")):
        assert callable(getattr(owner, name)), name
        assert name in driver.__doc__, name
    assert state.DONE is not state.FAILED and callable(modes.capture_modes)
