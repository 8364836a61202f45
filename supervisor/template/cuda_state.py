"""Whether this process holds a CUDA context, as the CUDA driver itself says: never an open file.

Loaded by path by engine_side.py (the engine venv's `supervisor` distribution shadows this
package there), so it imports only the standard library.

A child forked after the parent's cuInit cannot use CUDA ("Cannot re-initialize CUDA in forked
subprocess", or the driver's own "initialization failed"); a child forked before it can. The
open /dev/nvidia-uvm says nothing of that: measured on an H200 (driver 580), NVML's device count
alone opens it and a forked child still allocates. libcuda answers without changing anything:
before cuInit every call but cuInit returns CUDA_ERROR_NOT_INITIALIZED, so `cuDeviceGet(&dev, 0)`
is the question (3: not initialised; CUDA_SUCCESS: initialised). Where torch is imported its own
flag is asked too: it is the state torch refuses to fork after. No libcuda: no CUDA at all.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

LIBCUDA = "libcuda.so.1"  # the driver's soname, which the CUDA runtime itself loads
CUDA_ERROR_NOT_INITIALIZED = 3


class LibCuda(Protocol):
    """The one libcuda function asked: ctypes' CDLL attribute, or a test's fake."""

    def cuDeviceGet(self, device: Any, ordinal: int) -> int: ...  # libcuda's own name


@dataclass(frozen=True)
class CudaState:
    initialised: bool
    reason: str  # what said so, for the template's report and its refusal


def load_libcuda() -> LibCuda | None:
    """The CUDA driver library, or None where the box has none (no NVIDIA driver)."""
    try:
        library = ctypes.CDLL(LIBCUDA)
    except OSError:
        return None
    library.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    library.cuDeviceGet.restype = ctypes.c_int
    return library


def driver_state(libcuda: LibCuda | None) -> CudaState:
    """Anything but "not initialised" counts as initialised: an answer this code cannot place
    (a failed cuInit leaves one) is no proof that a forked child could start CUDA."""
    if libcuda is None:
        return CudaState(False, f"{LIBCUDA} absent: no CUDA driver")
    device = ctypes.c_int(-1)
    code = libcuda.cuDeviceGet(ctypes.byref(device), 0)
    if code == CUDA_ERROR_NOT_INITIALIZED:
        return CudaState(False, f"cuDeviceGet answered {code}: CUDA not initialised")
    return CudaState(True, f"cuDeviceGet answered {code}: the CUDA driver is initialised")


def cuda_state(load: Callable[[], LibCuda | None] = load_libcuda,
               modules: Mapping[str, Any] | None = None) -> CudaState:
    """torch's flag where torch is imported, then the driver's own state. load and modules are
    the seams (default: the real library, sys.modules)."""
    torch = (sys.modules if modules is None else modules).get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return CudaState(True, "torch.cuda.is_initialized() is true")
    return driver_state(load())
