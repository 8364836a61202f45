"""A fake `pynvml` that behaves as nvidia-ml-py 13 does where the monitor depends on it: its
error classes, the newer temperature call, the version-mismatch exception that is not an
NVMLError, MIG's refused process listing, host PIDs, and calls that block on a sick GPU."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml as real_nvml

UUID = "GPU-5a3c1f4e-0000-1111-2222-333344445555"
GIB = 1024**3
XID_EVENT = real_nvml.nvmlEventTypeXidCriticalError
BLOCK_LIMIT_S = 10.0


# The NVMLError hierarchy, named as nvidia-ml-py names it (NVML_ERROR_GPU_IS_LOST → GpuIsLost).
class NVMLError(Exception):
    value = 999


class NVMLError_GpuIsLost(NVMLError):
    value = real_nvml.NVML_ERROR_GPU_IS_LOST


class NVMLError_NotSupported(NVMLError):
    value = real_nvml.NVML_ERROR_NOT_SUPPORTED


class NVMLError_LibraryNotFound(NVMLError):
    value = real_nvml.NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_DriverNotLoaded(NVMLError):
    value = real_nvml.NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    value = real_nvml.NVML_ERROR_TIMEOUT


class NVMLError_NotFound(NVMLError):
    value = real_nvml.NVML_ERROR_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    value = real_nvml.NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_NoPermission(NVMLError):
    value = real_nvml.NVML_ERROR_NO_PERMISSION


class NVMLError_InvalidArgument(NVMLError):
    value = real_nvml.NVML_ERROR_INVALID_ARGUMENT


class NVMLError_Unknown(NVMLError):
    value = real_nvml.NVML_ERROR_UNKNOWN


class NVMLError_ResetRequired(NVMLError):
    value = real_nvml.NVML_ERROR_RESET_REQUIRED


class NVMLLibraryMismatchError(Exception):
    """What nvidia-ml-py raises for an unversioned call (_v3) this driver's NVML lacks."""


ERRORS = [
    NVMLError,
    NVMLError_GpuIsLost,
    NVMLError_NotSupported,
    NVMLError_LibraryNotFound,
    NVMLError_DriverNotLoaded,
    NVMLError_Timeout,
    NVMLError_NotFound,
    NVMLError_FunctionNotFound,
    NVMLError_NoPermission,
    NVMLError_InvalidArgument,
    NVMLError_Unknown,
    NVMLError_ResetRequired,
]
DEVICE_FUNCTIONS = [
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait",
]

# Device calls that answer one setting of the GPU as it stands: function name → FakeGpu attribute.
READINGS = {
    "nvmlDeviceGetCurrentClocksEventReasons": "clock_reasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons": "clock_reasons",  # before nvidia-ml-py 12
    "nvmlDeviceGetRetiredPagesPendingStatus": "retired_pending",
    "nvmlDeviceGetRemappedRows": "remapped_rows",  # (corrected, uncorrected, pending, failed)
}


class FakeGpu:
    """One GPU behind a fake NVML; `module()` is what the monitor sees as `pynvml`."""

    def __init__(self) -> None:
        self.init_error: type[NVMLError] | None = None
        self.lost = False  # every device call then raises GpuIsLost
        self.fail: dict[str, type[NVMLError]] = {}  # function name → error it raises
        self.calls: list[str] = []
        self.clock_reasons = 0
        self.events: list[Any] = []
        self.remapped_rows = (0, 0, 0, 0)
        self.retired_pending = 0
        self.process_pids: list[list[int]] = [[]]  # one list per call; the last one repeats
        self.shut_down = False
        self.event_set_freed = False
        self.driver_has_v3 = True  # an older driver lacks _v3: the unversioned call mismatches
        self.memory_used = [20 * GIB]  # one per call; the last one repeats
        # A sick GPU: every device call blocks until `block` is set (or BLOCK_LIMIT_S passes,
        # so a test whose loop is frozen fails instead of hanging); `blocking` says one is.
        self.block: threading.Event | None = None
        self.blocking = threading.Event()
        self.unblocked: list[bool] = []  # per blocked call: released by `block`, not the limit

    def module(self, *, drop: tuple[str, ...] = ()) -> ModuleType:
        module = ModuleType("pynvml")
        for error in ERRORS:
            setattr(module, error.__name__, error)
        module.nvmlEventTypeXidCriticalError = XID_EVENT  # type: ignore[attr-defined]
        module.NVMLLibraryMismatchError = NVMLLibraryMismatchError  # type: ignore[attr-defined]
        for name in dir(self):
            if name.startswith("nvml") and name not in drop:
                setattr(module, name, getattr(self, name))
        for name, attribute in READINGS.items():
            if name not in drop:
                setattr(module, name, self._reading(name, attribute))
        return module

    def _reading(self, name: str, attribute: str) -> Callable[[str], Any]:
        """The device call `name`, answering the test's setting `attribute`."""

        def call(handle: str) -> Any:
            self._device_call(name)
            return getattr(self, attribute)

        return call

    def _device_call(self, name: str) -> None:
        self.calls.append(name)
        if self.block is not None:
            self.blocking.set()
            self.unblocked.append(self.block.wait(BLOCK_LIMIT_S))
        if self.lost:
            raise NVMLError_GpuIsLost()
        if name in self.fail:
            raise self.fail[name]()

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index != 0:
            raise NVMLError_InvalidArgument()
        return "handle-0"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != UUID:
            raise NVMLError_NotFound()
        return "handle-0"

    def nvmlDeviceGetName(self, handle: str) -> str:
        self._device_call("nvmlDeviceGetName")
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        self._device_call("nvmlDeviceGetUUID")
        return UUID.encode()  # old nvidia-ml-py releases return bytes

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        self._device_call("nvmlDeviceGetMemoryInfo")
        used = self.memory_used.pop(0) if len(self.memory_used) > 1 else self.memory_used[0]
        return SimpleNamespace(total=141 * GIB, used=used, free=141 * GIB - used)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._device_call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        self._device_call("nvmlDeviceGetTemperature")
        assert sensor == real_nvml.NVML_TEMPERATURE_GPU
        return 71

    def nvmlDeviceGetTemperatureV(
        self, handle: str, sensor: int, version: int = real_nvml.nvmlTemperature_v1
    ) -> int:
        """nvidia-ml-py 13's call; a driver before it answers FunctionNotFound."""
        self._device_call("nvmlDeviceGetTemperatureV")
        assert sensor == real_nvml.NVML_TEMPERATURE_GPU
        assert version == real_nvml.nvmlTemperature_v1
        return 72

    def nvmlDeviceGetTotalEccErrors(self, handle: str, error_type: int, counter: int) -> int:
        self._device_call("nvmlDeviceGetTotalEccErrors")
        assert error_type == real_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == real_nvml.NVML_VOLATILE_ECC
        return 2

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        """As nvidia-ml-py 13: the unversioned call is _v3, and a driver without it raises
        NVMLLibraryMismatchError, which is not an NVMLError."""
        self._device_call("nvmlDeviceGetComputeRunningProcesses")
        if not self.driver_has_v3:
            raise NVMLLibraryMismatchError("use a versioned function")
        return self._processes()

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: str) -> list[Any]:
        self._device_call("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._processes()

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list[Any]:
        self._device_call("nvmlDeviceGetGraphicsRunningProcesses")
        if not self.driver_has_v3:
            raise NVMLLibraryMismatchError("use a versioned function")
        return []

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: str) -> list[Any]:
        self._device_call("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return []

    def _processes(self) -> list[Any]:
        pids = self.process_pids.pop(0) if len(self.process_pids) > 1 else self.process_pids[0]
        return [SimpleNamespace(pid=pid, usedGpuMemory=GIB) for pid in pids]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: str, mask: int, event_set: str) -> None:
        self._device_call("nvmlDeviceRegisterEvents")
        assert mask == XID_EVENT

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        self._device_call("nvmlEventSetWait")
        assert timeout_ms == 0, "the drain must never block"
        if not self.events:
            raise NVMLError_Timeout()
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.event_set_freed = True

    def xid(self, xid: int) -> None:
        self.events.append(SimpleNamespace(eventType=XID_EVENT, eventData=xid))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
