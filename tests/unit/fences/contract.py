"""What every fence's contract test needs: a failure that names the fence, the dependency and the
assumption that no longer holds, and a check that pyproject.toml bounds the dependency above."""

from __future__ import annotations

import ast
import inspect
import platform
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


@dataclass(frozen=True)
class Fence:
    """One fence (its module) around one dependency (its distribution name)."""

    module: str  # "appliance/fences/litestar.py"
    dependency: str  # "litestar"
    pinned_in: str = "pyproject.toml"  # where its version bound is moved

    @property
    def installed(self) -> str:
        if self.dependency == "python":  # a fence around the standard library's internals
            return platform.python_version()
        return version(self.dependency)

    def require(self, holds: bool, assumption: str, found: object = "") -> None:
        """Fail loudly unless the fence's `assumption` holds for the installed dependency."""
        if not holds:
            pytest.fail(
                f"FENCE {self.module} is broken by {self.dependency} {self.installed}: it "
                f"assumes {assumption}" + (f"; found {found!r}" if found != "" else "") + ". "
                f"Re-read that module against this version, mend it, and move the upper bound "
                f"of {self.dependency} in {self.pinned_in}.", pytrace=False)

    def attribute(self, owner: object, name: str) -> Any:
        """`owner.name`, which the fence relies on."""
        self.require(hasattr(owner, name), f"{_name(owner)}.{name} exists")
        return getattr(owner, name)

    def parameters(self, function: Callable[..., object], expected: list[str]) -> None:
        """The function takes exactly these parameters, in this order."""
        found = list(inspect.signature(function).parameters)
        self.require(found == expected, f"{_name(function)} takes ({', '.join(expected)})", found)

    def body(self, function: Callable[..., object], expected: str) -> None:
        """The function's code (docstring, comments and layout aside) is `expected`: the fence
        replaces or repeats it, so any change there must be read before the fence is trusted."""
        found = _code(ast.parse(textwrap.dedent(inspect.getsource(function))).body[0])
        self.require(found == _code(ast.parse(textwrap.dedent(expected))),
                     f"{_name(function)} does exactly: {expected.strip()}", found)

    def bounded(self) -> None:
        """pyproject.toml bounds the dependency above, and the installed version is inside."""
        dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
        wanted = [Requirement(d) for d in dependencies if Requirement(d).name == self.dependency]
        self.require(len(wanted) == 1, "one requirement in pyproject.toml", wanted)
        specifier = wanted[0].specifier
        self.require(any(s.operator in ("<", "<=", "~=", "==") for s in specifier),
                     "an upper version bound in pyproject.toml", str(specifier))
        self.require(Version(self.installed) in specifier,
                     f"the installed version is within pyproject.toml's {specifier}")


def _code(node: ast.AST) -> str:
    """The statements of a function (or module), without a leading docstring, as one line each."""
    body = list(getattr(node, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.unparse(statement) for statement in body)


def _name(thing: object) -> str:
    return str(getattr(thing, "__qualname__", None) or getattr(thing, "__name__", thing))
