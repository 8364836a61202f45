"""The code's shape: no import cycle among the modules of appliance/ and supervisor/ (type-only
and function-level imports count: each is a boundary drawn the wrong way round), and no module
there longer than MAX_LINES (one responsibility per module)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("appliance", "supervisor")
MAX_LINES = 450


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages by dotted name; a package by its own name (its __init__)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of `known` that module `name` imports anywhere in its text: at the top, under
    `if TYPE_CHECKING:`, or inside a function. A name imported from a package that is not one
    of its modules is the package's __init__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _within(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield from _within(submodule if submodule in known else base, known)


def _within(target: str, known: dict[str, Path]) -> Iterator[str]:
    """`target`, or the nearest package above it that is one of `known` (`import a.b` of an
    attribute `b` of package `a` is an import of `a`)."""
    while target:
        if target in known:
            yield target
            return
        target = target.rpartition(".")[0]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: set(imported(name, path, known)) - {name} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan's), as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(_path_through(graph, members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_through(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """One cycle inside a strongly connected set, from its first module back to it."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return [*paths[node], start]
            if target not in paths:
                paths[target] = [*paths[node], target]
                frontier.append(target)
    raise AssertionError(f"no cycle through {sorted(members)}")


def long_modules(root: Path = ROOT) -> dict[str, int]:
    counts = {name: len(path.read_text("utf-8").splitlines())
              for name, path in modules(root).items()}
    return {name: count for name, count in counts.items() if count > MAX_LINES}


def test_no_import_cycle_among_the_modules_of_appliance_and_supervisor() -> None:
    found = cycles(import_graph())
    assert found == [], "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_module_of_appliance_or_supervisor_is_longer_than_the_limit() -> None:
    assert long_modules() == {}, f"modules over {MAX_LINES} lines: {long_modules()}"


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A type-only import, a function-level one, a relative one and one of a package's name
    each make an edge, and a cycle through any of them is found."""
    tree = tmp_path / "appliance"
    (tree / "pkg").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "pkg" / "__init__.py").write_text("from appliance.pkg.c import C\n")
    (tree / "a.py").write_text("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from appliance.b import B\n")
    (tree / "b.py").write_text("def late():\n    from . import a\n")
    (tree / "pkg" / "c.py").write_text("from appliance import pkg\nfrom ..a import x\n")
    (tree / "d.py").write_text("import appliance.pkg\n")
    graph = import_graph(tmp_path)
    assert graph["appliance.a"] == {"appliance.b"}
    assert graph["appliance.b"] == {"appliance.a"}
    assert graph["appliance.pkg.c"] == {"appliance.pkg", "appliance.a"}
    assert graph["appliance.d"] == {"appliance.pkg"}
    assert cycles(graph) == [["appliance.a", "appliance.b", "appliance.a"],
                             ["appliance.pkg", "appliance.pkg.c", "appliance.pkg"]]


def test_a_module_over_the_limit_is_named(tmp_path: Path) -> None:
    (tmp_path / "supervisor").mkdir()
    (tmp_path / "supervisor" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "supervisor" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == {"supervisor.long": MAX_LINES + 1}
