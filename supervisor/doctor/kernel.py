"""The kernel side of CUDA under the unit's sandbox: nvidia_uvm loaded at boot, and the device
nodes present and admitted by the unit's DeviceAllow.

The unit sets NoNewPrivileges and ProtectKernelModules: CUDA's setuid nvidia-modprobe cannot
load nvidia-uvm (nor create /dev/nvidia-uvm) on demand from inside it, so something outside
must do it at boot (a modules-load.d entry; install.sh --system writes one on a GPU box).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from appliance.core.sections import EngineSettings
from supervisor.doctor.box import Box
from supervisor.doctor.driver import engine_is_gpu
from supervisor.doctor.report import Finding, blocker, ok, skip, warning

UVM = "uvm"
DEVICES = "devices"
MODULES_LOAD_FILE = "/etc/modules-load.d/chat-appliance.conf"
_BOOT_LISTS = ("/etc/modules-load.d", "/run/modules-load.d", "/usr/lib/modules-load.d",
               "/lib/modules-load.d")
INSTALLED_UNIT = "/etc/systemd/system/chat-appliance.service"
CHECKOUT_UNIT = Path(__file__).resolve().parents[2] / "systemd" / "chat-appliance.service"
REQUIRED_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
_LOAD_FIX = (f"modprobe nvidia-uvm && echo nvidia-uvm > {MODULES_LOAD_FILE} "
             "(or run install.sh --system, which writes that file)")


def _loaded_at_boot(box: Box) -> str | None:
    """The file that has nvidia-uvm loaded at boot, if any."""
    candidates = [box.path("/etc/modules")]
    for folder in _BOOT_LISTS:
        candidates += sorted(box.path(folder).glob("*.conf"))
    for candidate in candidates:
        try:
            lines = candidate.read_text().splitlines()
        except OSError:
            continue
        names = {line.split("#")[0].strip().replace("-", "_") for line in lines}
        if "nvidia_uvm" in names:
            return "/" + str(candidate.relative_to(box.root))
    return None


def check_uvm(box: Box, engine: EngineSettings) -> Finding:
    if not engine_is_gpu(box, engine):
        return skip(UVM, "no GPU: CPU engine")
    modules = box.read_text("/proc/modules") or ""
    loaded = any(line.split(" ", 1)[0] == "nvidia_uvm" for line in modules.splitlines())
    at_boot = _loaded_at_boot(box)
    if not loaded:
        return blocker(UVM, "nvidia_uvm is not loaded, and the service's sandbox cannot load it",
                       _LOAD_FIX)
    if at_boot is None:
        return warning(UVM, "nvidia_uvm is loaded now, but nothing loads it at boot: the first "
                       "start after a reboot will fail", _LOAD_FIX)
    return ok(UVM, f"nvidia_uvm loaded, and at boot by {at_boot}")


def unit_allows(unit_text: str) -> tuple[set[str], list[str]]:
    """The unit's DeviceAllow: paths, and the char-<group> globs (by /proc/devices name)."""
    paths, groups = set(), []
    for line in unit_text.splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() != "DeviceAllow" or not value.strip():
            continue
        spec = value.split()[0]
        if spec.startswith("char-"):
            groups.append(spec.removeprefix("char-"))
        else:
            paths.add(spec)
    return paths, groups


def _majors(box: Box) -> dict[int, str]:
    """Character device majors -> driver names, from /proc/devices."""
    names: dict[int, str] = {}
    section = ""
    for line in (box.read_text("/proc/devices") or "").splitlines():
        if line.endswith(":"):
            section = line
        elif section.startswith("Character") and line.split():
            number, _, name = line.strip().partition(" ")
            names[int(number)] = name.strip()
    return names


def check_device_nodes(box: Box, engine: EngineSettings) -> Finding:
    if not engine_is_gpu(box, engine):
        return skip(DEVICES, "no GPU: CPU engine")
    nodes = box.device_nodes()
    present = {path for path, _ in nodes}
    missing = [node for node in REQUIRED_NODES if node not in present]
    if missing:
        return blocker(DEVICES, f"{', '.join(missing)} missing: CUDA cannot start",
                       "nvidia-modprobe -u -c=0 as root (creates the nodes); load nvidia-uvm at boot")
    unit_text = box.read_text(INSTALLED_UNIT) or CHECKOUT_UNIT.read_text()
    paths, groups = unit_allows(unit_text)
    majors = _majors(box)
    refused = [path for path, major in nodes
               if path not in paths
               and not any(fnmatch.fnmatchcase(majors.get(major, ""), g) for g in groups)]
    if refused:
        return blocker(DEVICES, f"the unit's DeviceAllow does not admit {', '.join(refused)}",
                       "add DeviceAllow=<node> rw to a drop-in: systemctl edit chat-appliance")
    return ok(DEVICES, f"{len(nodes)} NVIDIA device nodes, all admitted by the unit")
