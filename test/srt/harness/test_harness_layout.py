"""The test suite's own layout: every test file is listed under its guarantee in docs/layout.md ("Tests by
guarantee"), each helper has one home (testing.pd_cluster, testing.pd_checks; conftest only for what it defines
itself) and no test module defines a copy of one. Static: reads the files, imports nothing of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import testing.pd_checks
import testing.pd_cluster

pytestmark = pytest.mark.unit

TEST_DIR = Path(__file__).resolve().parent
LAYOUT = TEST_DIR.parents[1] / "docs" / "layout.md"
HELPER_MODULES = (testing.pd_cluster, testing.pd_checks)
# Same name, different thing: a /generate over http.client whose client socket the test closes
# (pd_checks.Leg goes through urllib and cannot disconnect).
NOT_COPIES = {("test_room_ledger_e2e.py", "Leg")}


def _test_files():
    return sorted(TEST_DIR.glob("test_*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_every_test_file_is_listed_under_its_guarantee():
    text = LAYOUT.read_text()
    section = text[text.index("## Tests by guarantee"):]
    missing = [p.name for p in _test_files() if p.name not in section]
    assert not missing, f"docs/layout.md, 'Tests by guarantee', does not list {missing}"


def test_names_imported_from_conftest_are_defined_there():
    conftest = _tree(TEST_DIR / "conftest.py")
    own = {t.id for node in conftest.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    own |= {node.target.id for node in conftest.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    own |= {node.name for node in conftest.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    borrowed = {}
    for path in _test_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                names = {a.name for a in node.names} - own
                if names:
                    borrowed[path.name] = sorted(names)
    assert not borrowed, f"imported through conftest, not from their home (testing.pd_checks / pd_cluster): {borrowed}"


def test_no_test_module_defines_a_copy_of_a_shared_helper():
    shared = {name: module.__name__ for module in HELPER_MODULES for name in dir(module)
              if not name.startswith("_") and callable(getattr(module, name))}
    copies = {}
    for path in _test_files():
        for node in _tree(path).body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in shared
                    and (path.name, node.name) not in NOT_COPIES):
                copies.setdefault(path.name, []).append(f"{node.name} (see {shared[node.name]})")
    assert not copies, f"copies of shared helpers: {copies}"
