"""The machine as the checks see it: one object, so that a test's fake box stands in for it.

Files are read under `root` (a temporary tree in the tests); what cannot be faked with files
(device numbers, bindable ports, NVML, another interpreter's paths, accounts) is a method.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.sections import GpuSettings
from supervisor.engine.gpu_budget import GpuMemory, read_gpu_memory

PYTHON_PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Account:
    """A user as permission bits see it."""

    name: str
    uid: int
    gids: frozenset[int]


@dataclass
class Box:
    root: Path = Path("/")
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def path(self, absolute: str | Path) -> Path:
        return self.root / str(absolute).lstrip("/")

    def read_text(self, absolute: str | Path) -> str | None:
        try:
            return self.path(absolute).read_text(errors="replace")
        except OSError:
            return None

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH"))

    def device_nodes(self) -> list[tuple[str, int]]:
        """The NVIDIA character devices present: (path, major number)."""
        nodes = []
        for node in sorted([*self.path("/dev").glob("nvidia*"),
                            *self.path("/dev/nvidia-caps").glob("*")]):
            try:
                info = node.stat()
            except OSError:
                continue
            if stat.S_ISCHR(info.st_mode):
                nodes.append(("/" + str(node.relative_to(self.root)), os.major(info.st_rdev)))
        return nodes

    def disk_free_bytes(self, path: Path) -> int:
        while not path.exists() and path != path.parent:
            path = path.parent
        return shutil.disk_usage(path).free

    def port_free(self, host: str, port: int) -> bool:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                return False
        return True

    def gpu_memory(self, settings: GpuSettings) -> GpuMemory | None:
        return read_gpu_memory(settings)

    def python_include(self, python: Path) -> Path | None:
        """Where `python` looks for Python.h (Triton's launcher build asks sysconfig the same)."""
        probe = "import sysconfig; print(sysconfig.get_paths()['include'])"
        try:
            done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True,
                                  timeout=PYTHON_PROBE_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return Path(done.stdout.strip())

    def stat(self, path: Path) -> os.stat_result:
        return self.path(path).stat()

    def lstat(self, path: Path) -> os.stat_result:
        return self.path(path).lstat()

    def account(self, name: str | None) -> Account | None:
        """The named user, or the one running this (None)."""
        try:
            entry = pwd.getpwnam(name) if name else pwd.getpwuid(os.getuid())
        except KeyError:
            return None
        groups = {g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem}
        return Account(entry.pw_name, entry.pw_uid, frozenset({entry.pw_gid, *groups}))
