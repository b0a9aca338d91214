"""The test suite's own layout: every test file lives in the folder of its guarantee under test/srt and is listed
there in docs/layout.md ("Tests by guarantee": one row per folder, one column per level), in the column of its
one level mark; file names are unique across folders (pytest imports a test module by its name); each helper
has one home (testing.pd_cluster, testing.pd_checks; conftest only for what it defines itself) and no test
module defines a copy of one. Static: reads the files, imports nothing of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import testing.pd_checks
import testing.pd_cluster

pytestmark = pytest.mark.unit

TEST_DIR = Path(__file__).resolve().parents[1]
LAYOUT = TEST_DIR.parents[1] / "docs" / "layout.md"
LEVELS = ("unit", "pair", "e2e")
TABLE_HEADER = "| folder | guarantee | unit | pair | e2e |"
HELPER_MODULES = (testing.pd_cluster, testing.pd_checks)
# Same name, different thing: a /generate over http.client whose client socket the test closes
# (pd_checks.Leg goes through urllib and cannot disconnect).
NOT_COPIES = {("test_room_ledger_e2e.py", "Leg")}


def _test_files():
    return sorted(TEST_DIR.rglob("test_*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _guarantee_table() -> "dict[str, dict[str, str]]":
    """docs/layout.md's 'Tests by guarantee' table: folder -> {file name: level column it is listed in}."""
    text = LAYOUT.read_text()
    lines = text[text.index("## Tests by guarantee"):].splitlines()
    start = lines.index(TABLE_HEADER) + 2  # past the header and its |---| line
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        folder, _guarantee, *cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(LEVELS), f"docs/layout.md: a row needs {TABLE_HEADER!r}'s columns: {line}"
        folder = folder.strip("`").rstrip("/")
        assert folder not in table, f"docs/layout.md: folder {folder} has two rows"
        table[folder] = {name: level for level, cell in zip(LEVELS, cells) for name in re.findall(r"test_\w+\.py", cell)}
    return table


def _level_marks(path: Path) -> "list[list[str]]":
    """The level marks of each `pytestmark = ...` assignment in a module's top level."""
    found = []
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            found.append([n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute) and n.attr in LEVELS
                          and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"])
    return found


def test_every_test_file_lives_in_its_guarantee_folder_listed_under_its_level():
    table = _guarantee_table()
    wrong = []
    for path in _test_files():
        folder = path.parent.relative_to(TEST_DIR).as_posix()
        listed = table.get(folder, {})
        marks = _level_marks(path)
        level = marks[0][0] if len(marks) == 1 and len(marks[0]) == 1 else None
        if folder == ".":
            wrong.append(f"{path.name}: directly in test/srt, not in its guarantee's folder")
        elif path.name not in listed:
            wrong.append(f"{folder}/{path.name}: not in the row of folder '{folder}/'")
        elif level is not None and listed[path.name] != level:
            wrong.append(f"{folder}/{path.name}: listed under {listed[path.name]}, marked {level}")
    for folder, names in table.items():
        wrong += [f"{folder}/{name}: listed, no such file" for name in names if not (TEST_DIR / folder / name).is_file()]
    assert not wrong, f"docs/layout.md, 'Tests by guarantee', against test/srt: {wrong}"


def test_test_file_names_are_unique_across_folders():
    seen = {}
    for path in _test_files():
        seen.setdefault(path.name, []).append(path.parent.relative_to(TEST_DIR).as_posix())
    twice = {name: folders for name, folders in seen.items() if len(folders) > 1}
    assert not twice, f"pytest imports a test module by its file name; in two folders: {twice}"


def test_every_test_module_sets_exactly_one_level_mark():
    wrong = {path.relative_to(TEST_DIR).as_posix(): marks for path in _test_files()
             if (marks := _level_marks(path)) == [] or len(marks) > 1 or len(marks[0]) != 1}
    assert not wrong, f"needs one `pytestmark` with exactly one of {LEVELS} (found per assignment): {wrong}"


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
