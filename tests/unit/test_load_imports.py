"""load/ never imports tests/: the tests import what both share from load.kit, never the other
way round, so a bench runs from a checkout without its test suite and a test helper cannot
quietly become a bench's dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, however nested (a function's, a
    TYPE_CHECKING block's): `import a.b` and `from a.b import c` both name a.b."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def imports_of_tests(source: str) -> list[tuple[int, str]]:
    return [(line, name) for line, name in imported_modules(ast.parse(source))
            if name == "tests" or name.startswith("tests.")]


def test_the_check_sees_every_form_of_import() -> None:
    source = ("import tests.net\nfrom tests.support import stack\n"
              "def f():\n    from tests import conftest\n"
              "import testsuite\nfrom load.kit import net\n")
    assert [name for _, name in imports_of_tests(source)] == ["tests.net", "tests.support", "tests"]


def test_no_module_in_load_imports_tests() -> None:
    files = sorted((ROOT / "load").rglob("*.py"))
    assert len(files) > 20, files  # the walk found the tree, not an empty folder
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in files
                 for line, name in imports_of_tests(path.read_text())]
    assert not offenders, "load/ imports tests/ (move what it needs to load/kit):\n" + "\n".join(
        offenders)
