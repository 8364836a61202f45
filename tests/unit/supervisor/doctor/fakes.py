"""A fake box: files under a temporary root, everything else answered from fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.sections import EngineSettings, GpuSettings
from appliance.core.settings import Settings
from supervisor.doctor.box import Account, Box
from supervisor.engine.gpu_budget import GIB, GpuMemory

DRIVER_580 = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release "
              "Build  (dvs-builder@U22-I3-AE18-23-3)  Tue Sep 23 09:55:41 UTC 2025\n")


@dataclass
class FakeBox(Box):
    nodes: list[tuple[str, int]] = field(default_factory=list)
    programs: dict[str, str] = field(default_factory=dict)
    include: Path | None = None
    memory: GpuMemory | None = None
    free_disk: int = 100 * GIB
    busy_ports: set[int] = field(default_factory=set)
    accounts: dict[str | None, Account] = field(default_factory=dict)

    def write(self, absolute: str, text: str) -> None:
        target = self.path(absolute)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def which(self, name: str) -> str | None:
        return self.programs.get(name)

    def device_nodes(self) -> list[tuple[str, int]]:
        return list(self.nodes)

    def disk_free_bytes(self, path: Path) -> int:
        return self.free_disk

    def port_free(self, host: str, port: int) -> bool:
        return port not in self.busy_ports

    def gpu_memory(self, settings: GpuSettings) -> GpuMemory | None:
        return self.memory

    def python_include(self, python: Path) -> Path | None:
        return self.include

    def account(self, name: str | None) -> Account | None:
        return self.accounts.get(name)


def gpu_box(root: Path, driver: str = DRIVER_580) -> FakeBox:
    """A box with the NVIDIA driver loaded."""
    box = FakeBox(root=root, env={})
    box.write("/proc/driver/nvidia/version", driver)
    return box


def engine_venv(root: Path, cuda: str | None) -> EngineSettings:
    """Engine settings whose venv holds a torch/version.py of that CUDA build."""
    venv = root / "engine-venv"
    version = venv / "lib" / "python3.12" / "site-packages" / "torch" / "version.py"
    version.parent.mkdir(parents=True)
    version.write_text(f"__version__ = '2.13.0'\ncuda: Optional[str] = {cuda!r}\n")
    (venv / "bin").mkdir()
    (venv / "bin" / "python").touch()
    return EngineSettings(python=venv / "bin" / "python", device="auto")


def settings_with(engine: EngineSettings) -> Settings:
    return Settings(engine=engine)
