"""The homes docs/DESIGN.md draws: what both processes share sits in appliance.core and imports
nothing else of the API; the supervisor reaches the API only through that floor, the fences and
the front door (appliance.app)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPERVISOR_MAY = ("appliance.core", "appliance.fences", "appliance.app")


def imported(package: str) -> Iterator[tuple[str, str]]:
    """(file, module) for every import in a package, type-only and function-local ones too."""
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield str(path.relative_to(REPO)), node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield str(path.relative_to(REPO)), alias.name


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_supervisor_reaches_the_api_only_through_its_floor_fences_and_front_door() -> None:
    reaching = [(f, m) for f, m in imported("supervisor")
                if within(m, ("appliance",)) and not within(m, SUPERVISOR_MAY)]
    assert reaching == []


def test_core_imports_nothing_else_of_the_api() -> None:
    above = [(f, m) for f, m in imported("appliance/core")
             if within(m, ("appliance",)) and not within(m, ("appliance.core",))]
    assert above == []


def test_no_loose_modules_beside_the_front_door() -> None:
    """Each part of the API has a folder; only the package marker and the front door are loose."""
    loose = sorted(p.name for p in (REPO / "appliance").glob("*.py"))
    assert loose == ["__init__.py", "app.py"]


def test_the_supervisor_keeps_only_its_entry_points_loose() -> None:
    loose = sorted(p.name for p in (REPO / "supervisor").glob("*.py"))
    assert loose == ["__init__.py", "main.py", "serve.py"]
