"""A C compiler and Python.h, needed only where the engine compiles (a GPU, not eager)."""

from __future__ import annotations

from pathlib import Path

from supervisor.doctor.report import Level
from supervisor.doctor.toolchain import check_compiler
from tests.unit.supervisor.doctor.fakes import FakeBox, engine_venv, gpu_box


def _box_with_headers(tmp_path: Path) -> FakeBox:
    box = gpu_box(tmp_path / "root")
    box.write("/usr/include/python3.12/Python.h", "")
    box.include = Path("/usr/include/python3.12")
    box.programs = {"gcc": "/usr/bin/gcc"}
    return box


def test_gcc_and_python_h_are_ok(tmp_path: Path) -> None:
    finding = check_compiler(_box_with_headers(tmp_path), engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.OK and finding.detail == {"compiler": "/usr/bin/gcc"}


def test_no_compiler_on_a_compiling_gpu_engine_is_a_blocker(tmp_path: Path) -> None:
    box = _box_with_headers(tmp_path)
    box.programs = {}
    finding = check_compiler(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER and "gcc" in finding.fix


def test_no_python_h_is_a_blocker(tmp_path: Path) -> None:
    box = _box_with_headers(tmp_path)
    box.include = Path("/usr/include/python3.11")
    finding = check_compiler(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER and "python3-dev" in finding.fix


def test_an_eager_gpu_engine_needs_no_compiler(tmp_path: Path) -> None:
    box = _box_with_headers(tmp_path)
    box.programs = {}
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"enforce_eager": True})
    assert check_compiler(box, engine).level is Level.SKIP


def test_the_cpu_engine_needs_no_compiler(tmp_path: Path) -> None:
    assert check_compiler(FakeBox(root=tmp_path), engine_venv(tmp_path, None)).level is Level.SKIP


def test_a_cc_that_does_not_exist_is_a_blocker(tmp_path: Path) -> None:
    box = _box_with_headers(tmp_path)
    box.env = {"CC": "cc-missing"}
    assert check_compiler(box, engine_venv(tmp_path, "13.0")).level is Level.BLOCKER
