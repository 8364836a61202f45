"""The NVML GPU monitor through a fake `pynvml` module, and once against the real one."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml as real_nvml
import pytest
from structlog.testing import capture_logs

from appliance.settings import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.readings import APPLICATION_XIDS, GpuReading, classify_xid

UUID = "GPU-5a3c1f4e-0000-1111-2222-333344445555"
GIB = 1024**3
XID_EVENT = real_nvml.nvmlEventTypeXidCriticalError


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
]
DEVICE_FUNCTIONS = [
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait",
]


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

    def module(self, *, drop: tuple[str, ...] = ()) -> ModuleType:
        module = ModuleType("pynvml")
        for error in ERRORS:
            setattr(module, error.__name__, error)
        module.nvmlEventTypeXidCriticalError = XID_EVENT  # type: ignore[attr-defined]
        for name in dir(self):
            if name.startswith("nvml") and name not in drop:
                setattr(module, name, getattr(self, name))
        return module

    def _device_call(self, name: str) -> None:
        self.calls.append(name)
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
        return SimpleNamespace(total=141 * GIB, used=20 * GIB, free=121 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._device_call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        self._device_call("nvmlDeviceGetTemperature")
        assert sensor == real_nvml.NVML_TEMPERATURE_GPU
        return 71

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        self._device_call("nvmlDeviceGetCurrentClocksEventReasons")
        return self.clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        self._device_call("nvmlDeviceGetCurrentClocksThrottleReasons")
        return self.clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: str, error_type: int, counter: int) -> int:
        self._device_call("nvmlDeviceGetTotalEccErrors")
        assert error_type == real_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == real_nvml.NVML_VOLATILE_ECC
        return 2

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> int:
        self._device_call("nvmlDeviceGetRetiredPagesPendingStatus")
        return self.retired_pending

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        self._device_call("nvmlDeviceGetRemappedRows")
        return self.remapped_rows

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        self._device_call("nvmlDeviceGetComputeRunningProcesses")
        pids = self.process_pids.pop(0) if len(self.process_pids) > 1 else self.process_pids[0]
        return [SimpleNamespace(pid=pid, usedGpuMemory=GIB) for pid in pids]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list[Any]:
        self._device_call("nvmlDeviceGetGraphicsRunningProcesses")
        return []

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


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()


def opened(gpu: FakeGpu, device: str = "0", **module_kwargs: Any) -> GpuMonitor:
    monitor = GpuMonitor(GpuSettings(device=device), gpu.module(**module_kwargs))
    monitor.open()
    return monitor


def test_fake_mirrors_the_real_pynvml_names() -> None:
    """A fake that drifted from nvidia-ml-py would let the monitor pass tests and fail on a GPU."""
    for error in ERRORS[1:]:
        assert issubclass(getattr(real_nvml, error.__name__), real_nvml.NVMLError)
    for name in [*DEVICE_FUNCTIONS, "nvmlDeviceGetCurrentClocksThrottleReasons"]:
        assert callable(getattr(real_nvml, name))


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_restart_the_worker(xid: int) -> None:
    assert classify_xid(xid) == "restart_worker"


@pytest.mark.parametrize("xid", [8, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120])
def test_other_critical_xids_fail(xid: int) -> None:
    assert classify_xid(xid) == "fail"


def test_application_xid_list_matches_the_device_plugin() -> None:
    assert {13, 31, 43, 45, 68, 109} == APPLICATION_XIDS


def test_open_finds_the_device_by_index(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    assert monitor.status == "ok"
    assert monitor.available
    assert monitor.events_supported
    assert monitor.summary()["name"] == "NVIDIA H200"
    assert monitor.summary()["uuid"] == UUID


def test_open_finds_the_device_by_uuid(gpu: FakeGpu) -> None:
    assert opened(gpu, device=UUID).status == "ok"


def test_unknown_device_is_unavailable_and_logged_as_error(gpu: FakeGpu) -> None:
    with capture_logs() as logs:
        monitor = opened(gpu, device="GPU-nope")
    assert monitor.status == "unavailable"
    assert gpu.shut_down
    assert monitor.summary() == {"status": "unavailable"}
    assert [(e["event"], e["log_level"]) for e in logs] == [("gpu.device_not_found", "error")]


def test_poll_reads_telemetry(gpu: FakeGpu) -> None:
    reading = opened(gpu).poll()
    assert reading.memory_used_bytes == 20 * GIB
    assert reading.memory_total_bytes == 141 * GIB
    assert reading.utilization_pct == 87
    assert reading.temperature_c == 71
    assert reading.ecc_uncorrected_volatile == 2
    assert reading.retired_pages_pending is False
    assert reading.row_remap_pending is False
    assert reading.xids == ()
    assert reading.verdict.action == "none"


def test_application_xid_asks_for_a_worker_restart_once(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.xid(13)
    reading = monitor.poll()
    assert reading.xids == (13,)
    assert reading.verdict.action == "restart_worker"
    assert "xid 13" in reading.verdict.cause
    assert monitor.status == "ok"
    assert monitor.poll().verdict.action == "none"  # the worker fault is over once reported
    assert monitor.summary()["last_xid"] == 13


def test_critical_xid_79_fails_and_stays_failed(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.xid(79)
    with capture_logs() as logs:
        reading = monitor.poll()
    assert reading.verdict.action == "fail"
    assert "xid 79" in reading.verdict.cause
    assert monitor.status == "unhealthy"
    assert monitor.poll().verdict.action == "fail"
    assert monitor.verdict().action == "fail"
    assert monitor.summary()["health"]["action"] == "fail"
    assert monitor.gauges()["gpu_healthy"] == 0.0
    xid_log = next(e for e in logs if e["event"] == "gpu.xid")
    assert xid_log["xid"] == 79
    assert xid_log["action"] == "fail"


def test_critical_xid_outranks_an_application_xid_in_the_same_poll(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.xid(13)
    gpu.xid(48)
    assert monitor.poll().verdict.action == "fail"


def test_events_other_than_xid_are_ignored(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.events.append(
        SimpleNamespace(eventType=real_nvml.nvmlEventTypeSingleBitEccError, eventData=0)
    )
    assert monitor.poll().xids == ()


def test_drain_stops_on_an_event_wait_error(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.fail["nvmlEventSetWait"] = NVMLError_Unknown
    with capture_logs() as logs:
        assert monitor.poll().verdict.action == "none"
    assert "gpu.event_wait_failed" in [e["event"] for e in logs]


@pytest.mark.parametrize(
    "failing", ["nvmlDeviceGetMemoryInfo", "nvmlEventSetWait", "nvmlDeviceGetRemappedRows"]
)
def test_gpu_lost_on_any_call_fails(gpu: FakeGpu, failing: str) -> None:
    monitor = opened(gpu)
    gpu.fail[failing] = NVMLError_GpuIsLost
    with capture_logs() as logs:
        reading = monitor.poll()
    assert reading.verdict.action == "fail"
    assert "lost" in reading.verdict.cause.lower()
    assert monitor.status == "lost"
    assert monitor.available  # still "open": the manager keeps reading the fail verdict
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["gpu.lost"]


def test_lost_gpu_is_not_queried_again(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.lost = True
    monitor.poll()
    gpu.calls.clear()
    assert monitor.poll().verdict.action == "fail"
    assert monitor.pids_using_memory() == set()
    assert gpu.calls == []
    assert monitor.gauges()["gpu_up"] == 0.0


def test_gpu_lost_at_open_fails(gpu: FakeGpu) -> None:
    gpu.lost = True
    monitor = opened(gpu)
    assert monitor.status == "lost"
    assert monitor.verdict().action == "fail"


def test_gpu_lost_while_listing_processes_fails(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.lost = True
    assert monitor.pids_using_memory() == set()
    assert monitor.verdict().action == "fail"


@pytest.mark.parametrize(
    ("reason", "thermal", "power"),
    [
        (real_nvml.nvmlClocksEventReasonSwThermalSlowdown, True, False),
        (real_nvml.nvmlClocksEventReasonHwThermalSlowdown, True, False),
        (real_nvml.nvmlClocksEventReasonSwPowerCap, False, True),
        (real_nvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, False, True),
        (real_nvml.nvmlClocksEventReasonGpuIdle, False, False),
        (real_nvml.nvmlClocksEventReasonNone, False, False),
    ],
)
def test_slowdown_flags_decode_the_real_nvml_bits(
    gpu: FakeGpu, reason: int, thermal: bool, power: bool
) -> None:
    gpu.clock_reasons = reason | real_nvml.nvmlClocksEventReasonGpuIdle
    reading = opened(gpu).poll()
    assert reading.thermal_slowdown is thermal
    assert reading.power_slowdown is power


def test_slowdown_reason_names(gpu: FakeGpu) -> None:
    gpu.clock_reasons = (
        real_nvml.nvmlClocksThrottleReasonSwThermalSlowdown
        | real_nvml.nvmlClocksThrottleReasonHwSlowdown
    )
    assert opened(gpu).poll().slowdown_reasons == ("hw_slowdown", "sw_thermal")


def test_thermal_slowdown_is_a_logged_warning_not_an_action(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.clock_reasons = real_nvml.nvmlClocksEventReasonSwThermalSlowdown
    with capture_logs() as logs:
        monitor.poll()
        monitor.poll()
        gpu.clock_reasons = 0
        monitor.poll()
    events = [e["event"] for e in logs]
    assert events == ["gpu.thermal_slowdown", "gpu.thermal_slowdown_cleared"]
    assert monitor.verdict().action == "none"


def test_thermal_slowdown_shows_in_summary(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.clock_reasons = real_nvml.nvmlClocksEventReasonHwThermalSlowdown
    monitor.poll()
    summary = monitor.summary()
    assert summary["thermal_slowdown"] is True
    assert summary["warnings"] == ["thermal_slowdown"]
    assert summary["health"] == {"action": "none", "cause": ""}
    assert monitor.gauges()["gpu_thermal_slowdown"] == 1.0


def test_older_throttle_reasons_name_is_used_when_the_new_one_is_missing(gpu: FakeGpu) -> None:
    gpu.clock_reasons = real_nvml.nvmlClocksThrottleReasonSwPowerCap
    monitor = opened(gpu, drop=("nvmlDeviceGetCurrentClocksEventReasons",))
    assert monitor.poll().power_slowdown
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in gpu.calls


def test_unsupported_queries_read_none_and_are_not_asked_again(gpu: FakeGpu) -> None:
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPagesPendingStatus"):
        gpu.fail[name] = NVMLError_NotSupported
    gpu.fail["nvmlDeviceGetRemappedRows"] = NVMLError_FunctionNotFound
    monitor = opened(gpu)
    with capture_logs() as logs:
        first = monitor.poll()
        monitor.poll()
    assert (first.ecc_uncorrected_volatile, first.retired_pages_pending) == (None, None)
    assert first.row_remap_pending is None
    assert gpu.calls.count("nvmlDeviceGetTotalEccErrors") == 1
    assert [e["query"] for e in logs if e["event"] == "gpu.query_unsupported"] == [
        "ecc",
        "retired_pages",
        "row_remap",
    ]
    assert first.verdict.action == "none"


def test_other_query_errors_read_none_with_a_warning(gpu: FakeGpu) -> None:
    gpu.fail["nvmlDeviceGetUtilizationRates"] = NVMLError_Unknown
    with capture_logs() as logs:
        reading = opened(gpu).poll()
    assert reading.utilization_pct is None
    assert reading.memory_used_bytes == 20 * GIB
    assert ("gpu.query_failed", "warning") in [(e["event"], e["log_level"]) for e in logs]


def test_pending_row_remap_and_retired_pages_are_warnings(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.remapped_rows = (3, 1, 1, 0)
    gpu.retired_pending = 1
    with capture_logs() as logs:
        reading = monitor.poll()
    assert reading.row_remap_pending is True
    assert reading.retired_pages_pending is True
    assert set(reading.warnings) == {"row_remap_pending", "retired_pages_pending"}
    assert sorted(e["condition"] for e in logs if e["event"] == "gpu.reset_pending") == [
        "retired_pages_pending",
        "row_remap_pending",
    ]
    assert reading.verdict.action == "none"


def test_xid_events_not_supported_falls_back_to_polling(gpu: FakeGpu) -> None:
    gpu.fail["nvmlDeviceRegisterEvents"] = NVMLError_NotSupported
    with capture_logs() as logs:
        monitor = opened(gpu)
    assert monitor.status == "ok"
    assert not monitor.events_supported
    assert gpu.event_set_freed
    assert "gpu.xid_events_unsupported" in [e["event"] for e in logs]
    monitor.poll()
    assert "nvmlEventSetWait" not in gpu.calls
    assert monitor.summary()["xid_events"] == "unsupported"


def test_gauges_carry_telemetry(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    monitor.poll()
    gauges = monitor.gauges()
    assert gauges["gpu_up"] == 1.0
    assert gauges["gpu_memory_used_bytes"] == 20 * GIB
    assert gauges["gpu_temperature_celsius"] == 71.0
    assert gauges["gpu_healthy"] == 1.0


def test_pids_using_memory_lists_compute_processes(gpu: FakeGpu) -> None:
    gpu.process_pids = [[4242, 4243]]
    assert opened(gpu).pids_using_memory() == {4242, 4243}


def test_wait_released_returns_once_the_pids_are_gone(gpu: FakeGpu) -> None:
    gpu.process_pids = [[4242, 999], [4242, 999], [4242, 999], [999]]
    monitor, clock = opened(gpu), FakeClock()
    released = asyncio.run(
        monitor.wait_released({4242}, 30.0, sleep=clock.sleep, clock=clock, interval_s=0.5)
    )
    assert released is True
    assert clock.sleeps == [0.5, 0.5, 0.5]  # released on the fourth look; pid 999 is not ours


def test_wait_released_times_out_when_never_released(gpu: FakeGpu) -> None:
    gpu.process_pids = [[4242]]
    monitor, clock = opened(gpu), FakeClock()
    with capture_logs() as logs:
        released = asyncio.run(
            monitor.wait_released({4242}, 2.0, sleep=clock.sleep, clock=clock, interval_s=0.75)
        )
    assert released is False
    assert clock.now == pytest.approx(102.0)
    assert clock.sleeps == [0.75, 0.75, 0.5]  # the last sleep ends at the deadline
    assert logs[-1]["event"] == "gpu.memory_not_released"
    assert logs[-1]["pids"] == [4242]


def test_close_frees_the_event_set_and_shuts_nvml_down(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    monitor.close()
    assert gpu.event_set_freed
    assert gpu.shut_down
    assert not monitor.available


@pytest.mark.parametrize("error", [NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded])
def test_nvml_absent_is_unavailable_logged_once_at_info(
    gpu: FakeGpu, error: type[NVMLError]
) -> None:
    gpu.init_error = error
    with capture_logs() as logs:
        monitor = opened(gpu)
        reading = monitor.poll()
    assert monitor.status == "unavailable"
    assert not monitor.available
    assert [(e["event"], e["log_level"]) for e in logs] == [("gpu.unavailable", "info")]
    assert reading == GpuReading()
    assert monitor.verdict().action == "none"
    assert monitor.summary() == {"status": "unavailable"}
    assert monitor.gauges() == {"gpu_up": 0.0}
    assert monitor.pids_using_memory() == set()
    clock = FakeClock()
    assert asyncio.run(monitor.wait_released({1}, 5.0, sleep=clock.sleep, clock=clock))
    assert clock.sleeps == []
    monitor.close()


def test_pynvml_not_installed_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    monitor = GpuMonitor(GpuSettings())
    monitor.open()
    assert monitor.status == "unavailable"
    monitor.close()


def test_disabled_monitor_never_touches_nvml(gpu: FakeGpu) -> None:
    gpu.init_error = NVMLError_Unknown  # would be logged as a warning if nvmlInit were called
    monitor = GpuMonitor(GpuSettings(enabled=False), gpu.module())
    with capture_logs() as logs:
        monitor.open()
    assert monitor.status == "disabled"
    assert [e["event"] for e in logs] == ["gpu.disabled"]
    assert monitor.summary() == {"status": "disabled"}


@pytest.mark.skipif(
    Path("/proc/driver/nvidia/version").exists(), reason="this machine has an NVIDIA driver"
)
def test_real_pynvml_without_a_gpu_is_unavailable_without_error() -> None:
    monitor = GpuMonitor(GpuSettings())  # imports the installed nvidia-ml-py
    with capture_logs() as logs:
        monitor.open()
    assert monitor.status == "unavailable"
    assert [e["log_level"] for e in logs] == ["info"]
    assert monitor.poll() == GpuReading()
    assert monitor.summary() == {"status": "unavailable"}
    assert asyncio.run(monitor.wait_released({1234}, 1.0))
    monitor.close()
