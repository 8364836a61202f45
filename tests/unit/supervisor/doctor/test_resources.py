"""GPU memory against the sized reservation, disk space, ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.settings import Settings, default_model
from supervisor.doctor.report import Level
from supervisor.doctor.resources import check_disk, check_gpu_memory, check_ports
from supervisor.engine.gpu_budget import GIB, GpuMemory
from tests.unit.supervisor.doctor.fakes import FakeBox, engine_venv, gpu_box


def _gpu_settings(tmp_path: Path) -> Settings:
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"model": default_model()})
    return Settings(engine=engine)


def test_a_desktop_gpu_with_a_screen_on_it_boots_the_bundled_model(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=24 * GIB, free_bytes=int(21.6 * GIB))
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.OK, finding.message
    assert finding.detail["limited_by"] == "model" and finding.detail["utilization"] < 0.9


def test_too_little_free_for_one_window_is_a_blocker_a_restart_may_cure(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=8 * GIB, free_bytes=2 * GIB)
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.BLOCKER and not finding.refuses_start


def test_less_free_than_the_kv_budget_is_a_warning(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=8 * GIB, free_bytes=6 * GIB)
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.WARNING and finding.detail["limited_by"] == "free memory"


def test_nvml_without_a_reading_is_a_blocker(tmp_path: Path) -> None:
    finding = check_gpu_memory(gpu_box(tmp_path / "root"), _gpu_settings(tmp_path))
    assert finding.level is Level.BLOCKER


def test_gpu_memory_on_a_cpu_box_is_skipped(tmp_path: Path) -> None:
    assert check_gpu_memory(FakeBox(root=tmp_path), Settings()).level is Level.SKIP


@pytest.mark.parametrize(("free_mib", "level"), [(4096, Level.OK), (100, Level.WARNING)])
def test_disk_space_under_the_cache_directory(free_mib: int, level: Level, tmp_path: Path) -> None:
    box = FakeBox(root=tmp_path, free_disk=free_mib * 1024**2)
    assert check_disk(box, Settings()).level is level


def test_a_busy_port_is_a_warning_naming_it(tmp_path: Path) -> None:
    box = FakeBox(root=tmp_path, busy_ports={8100})
    finding = check_ports(box, Settings())
    assert finding.level is Level.WARNING and "worker 127.0.0.1:8100" in finding.message
    assert check_ports(FakeBox(root=tmp_path), Settings()).level is Level.OK
