"""The template's own rules: what it agrees to run as the spawned worker would run, and how it
proves it holds no GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from supervisor.template.engine_side import (
    Start,
    changed_environment,
    open_files,
    validate,
    worker_environment,
)


@pytest.mark.parametrize(("argv", "fds", "refusal"), [
    ([sys.executable, "-m", "pkg.mod", "--x"], [5, 6], None),
    ([sys.executable, "script.py"], [5, 6], None),
    (["/usr/bin/python3", "-m", "pkg.mod"], [5, 6], "is not this template's interpreter"),
    ([sys.executable, "-X", "dev", "-m", "pkg.mod"], [5, 6], "option -X is not supported"),
    ([sys.executable, "-m"], [5, 6], "option -m is not supported"),
    ([sys.executable, "-m", "pkg.mod"], [5], "expected 2 fds"),
    ("python -m pkg", [5, 6], "argv must be a list"),
])
def test_a_start_is_run_only_as_the_spawned_worker_would_be(
        argv: object, fds: list[int], refusal: str | None) -> None:
    start = validate({"op": "start", "argv": argv, "env": {"A": "1"}, "cwd": "/"}, fds)
    if refusal is None:
        assert start == Start(argv, {"A": "1"}, "/", fds)  # type: ignore[arg-type]
    else:
        assert isinstance(start, str) and refusal in start


def test_unknown_requests_are_refused() -> None:
    assert validate({"op": "exec"}, []) == "unknown op 'exec'"


def test_device_files_held_open_are_found(tmp_path: Path) -> None:
    """What the template reports of the GPU's device files it holds (never its CUDA verdict)."""
    held = tmp_path / "nvidia0"
    held.touch()
    assert open_files(str(tmp_path)) == []
    with held.open():
        assert open_files(str(tmp_path)) == [str(held)]


def test_the_worker_gets_what_the_imports_set_unless_the_supervisor_set_it_since() -> None:
    before = {"PATH": "/bin", "KEEP": "x", "GONE": "1", "MINE": "old"}
    after = {"PATH": "/bin", "KEEP": "x", "NEW": "set", "MINE": "imported"}
    changed = changed_environment(before, after)
    assert changed == {"NEW": "set", "MINE": "imported", "GONE": None}
    sent = {"PATH": "/bin", "KEEP": "x", "GONE": "1", "MINE": "operator"}
    assert worker_environment(sent, before, changed) == {
        "PATH": "/bin", "KEEP": "x", "NEW": "set", "MINE": "operator"}
