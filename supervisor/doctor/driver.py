"""The NVIDIA driver against the CUDA version the engine venv's torch was built for.

PyPI's torch 2.13.0 (what vLLM 0.32.0 pins) is a CUDA 13.0 build: on a 535/550/570 driver the
install succeeds and the first CUDA start fails. The torch build is read from its
torch/version.py, as text: importing torch would initialise nothing, but costs seconds.
The minimum drivers are NVIDIA's CUDA release notes' table (Linux, x86_64), not measured here.
"""

from __future__ import annotations

import re
from pathlib import Path

from appliance.core.sections import EngineSettings
from supervisor.doctor.box import Box
from supervisor.doctor.report import Finding, blocker, ok, skip, warning

CHECK = "driver"
# What the engine venv install.sh builds on a GPU will hold, before it is built.
PINNED_TORCH_CUDA = "13.0"
# Toolkit -> the driver it was released with (full support) ...
TOOLKIT_DRIVER = {(13, 0): (580, 65), (12, 9): (575, 51), (12, 8): (570, 26),
                  (12, 6): (560, 28), (12, 4): (550, 54), (12, 1): (530, 30),
                  (12, 0): (525, 60), (11, 8): (520, 61)}
# ... and the oldest driver of the toolkit's major (minor version compatibility: it runs,
# but kernels shipped only as newer PTX cannot be JIT-compiled).
MAJOR_DRIVER = {13: (580, 0), 12: (525, 60), 11: (450, 80)}
_DRIVER_LINE = re.compile(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+)\.(\d+)")


def engine_is_gpu(box: Box, engine: EngineSettings) -> bool:
    if engine.device != "auto":
        return engine.device == "cuda"
    return box.path("/proc/driver/nvidia/version").exists()


def torch_cuda_version(engine_python: Path) -> str | None:
    """`cuda = '13.0'` from torch/version.py in the venv of engine_python; None when torch is
    not there (yet), "" for a build without CUDA."""
    venv = engine_python.parent.parent
    for version_file in sorted(venv.glob("lib/python3*/site-packages/torch/version.py")):
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]?([\w.]+)", version_file.read_text(), re.M)
        return "" if match is None or match.group(1) == "None" else match.group(1)
    return None


def driver_version(box: Box) -> tuple[int, int] | None:
    text = box.read_text("/proc/driver/nvidia/version") or ""
    match = _DRIVER_LINE.search(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_driver(box: Box, engine: EngineSettings) -> Finding:
    if not engine_is_gpu(box, engine):
        return skip(CHECK, "no GPU: CPU engine")
    driver = driver_version(box)
    if driver is None:
        return blocker(CHECK, "no NVIDIA driver loaded (/proc/driver/nvidia/version)",
                       "install NVIDIA's driver 580 or later and reboot")
    cuda = torch_cuda_version(engine.python)
    origin = f"torch in {engine.python.parent.parent}"
    if cuda is None:
        cuda, origin = PINNED_TORCH_CUDA, "the torch install.sh will build (not installed yet)"
    if cuda == "":
        return blocker(CHECK, f"{origin} is a CPU build on a GPU box",
                       "rebuild the engine venv: CHAT_APPLIANCE_ENGINE__DEVICE=cuda bash install.sh")
    major, minor = (int(part) for part in cuda.split(".")[:2])
    shown = f"driver {driver[0]}.{driver[1]:02d}, CUDA {cuda} ({origin})"
    oldest = MAJOR_DRIVER.get(major, (0, 0))
    if driver < oldest:
        return blocker(CHECK, f"{shown}: CUDA {major} needs driver {oldest[0]} or later",
                       f"upgrade the NVIDIA driver to {TOOLKIT_DRIVER.get((major, minor), oldest)[0]}"
                       " or later (Debian/Ubuntu: the nvidia-driver package of that version)",
                       driver=f"{driver[0]}.{driver[1]}", cuda=cuda)
    if driver < TOOLKIT_DRIVER.get((major, minor), oldest):
        return warning(CHECK, f"{shown}: runs by minor version compatibility only (no PTX JIT)",
                       f"upgrade the driver to {TOOLKIT_DRIVER[(major, minor)][0]} or later",
                       driver=f"{driver[0]}.{driver[1]}", cuda=cuda)
    return ok(CHECK, shown, driver=f"{driver[0]}.{driver[1]}", cuda=cuda)
