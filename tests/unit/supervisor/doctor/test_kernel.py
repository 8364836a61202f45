"""nvidia_uvm loaded (and at boot), and the device nodes present and admitted by the unit."""

from __future__ import annotations

from pathlib import Path

from supervisor.doctor.kernel import check_device_nodes, check_uvm, unit_allows
from supervisor.doctor.report import Level
from tests.unit.supervisor.doctor.fakes import FakeBox, engine_venv, gpu_box

MODULES = "nvidia_uvm 1560576 0 - Live 0x0000000000000000 (POE)\nnvidia 60882944 1 nvidia_uvm\n"
DEVICES = ("Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n510 nvidia-caps\n"
           "\nBlock devices:\n  8 sd\n")
NODES = [("/dev/nvidia0", 195), ("/dev/nvidiactl", 195), ("/dev/nvidia-uvm", 508),
         ("/dev/nvidia-uvm-tools", 508)]


def test_uvm_loaded_and_listed_for_boot_is_ok(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.write("/proc/modules", MODULES)
    box.write("/etc/modules-load.d/chat-appliance.conf", "# for CUDA\nnvidia-uvm\n")
    finding = check_uvm(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.OK and "chat-appliance.conf" in finding.message


def test_uvm_not_loaded_is_a_blocker_saying_how_to_load_it_at_boot(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.write("/proc/modules", "nvidia 60882944 0 - Live 0x0\n")
    finding = check_uvm(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER and "modules-load.d" in finding.fix


def test_uvm_loaded_but_not_at_boot_is_a_warning(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.write("/proc/modules", MODULES)
    box.write("/etc/modules-load.d/other.conf", "loop\n")
    assert check_uvm(box, engine_venv(tmp_path, "13.0")).level is Level.WARNING


def test_uvm_on_a_cpu_box_is_skipped(tmp_path: Path) -> None:
    assert check_uvm(FakeBox(root=tmp_path), engine_venv(tmp_path, None)).level is Level.SKIP


def test_the_shipped_unit_admits_the_usual_nodes_and_a_mig_capability(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.write("/proc/devices", DEVICES)
    box.nodes = [*NODES, ("/dev/nvidia-caps/nvidia-cap1", 510), ("/dev/nvidia1", 195)]
    finding = check_device_nodes(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.OK, finding


def test_a_node_the_installed_unit_does_not_admit_is_a_blocker(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.write("/proc/devices", DEVICES)
    box.write("/etc/systemd/system/chat-appliance.service",
              "[Service]\nDeviceAllow=/dev/nvidiactl rw\nDeviceAllow=/dev/nvidia-uvm rw\n")
    box.nodes = NODES
    finding = check_device_nodes(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER
    assert "/dev/nvidia0" in finding.message and "/dev/nvidiactl" not in finding.message


def test_a_missing_uvm_node_is_a_blocker(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.nodes = NODES[:2]
    finding = check_device_nodes(box, engine_venv(tmp_path, "13.0"))
    assert finding.level is Level.BLOCKER and "/dev/nvidia-uvm" in finding.message


def test_unit_allows_reads_paths_and_device_groups() -> None:
    paths, groups = unit_allows("DeviceAllow=/dev/nvidia0 rw\nDeviceAllow=char-nvidia* rw\n# x\n")
    assert paths == {"/dev/nvidia0"} and groups == ["nvidia*"]
