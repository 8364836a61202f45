"""The NVML GPU monitor through a fake `pynvml` module, and once against the real one."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as real_nvml
import pytest
from structlog.testing import capture_logs

from appliance.core.sections import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.readings import GpuReading
from tests.unit.supervisor.gpu.fake_nvml import (
    DEVICE_FUNCTIONS,
    ERRORS,
    GIB,
    UUID,
    FakeGpu,
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_FunctionNotFound,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
    NVMLError_ResetRequired,
    NVMLError_Unknown,
)


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
    for name in [*DEVICE_FUNCTIONS, "nvmlDeviceGetCurrentClocksThrottleReasons",
                 "nvmlDeviceGetComputeRunningProcesses_v2"]:
        assert callable(getattr(real_nvml, name))
    assert not issubclass(real_nvml.NVMLLibraryMismatchError, real_nvml.NVMLError)


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
    assert reading.temperature_c == 72  # nvmlDeviceGetTemperatureV, nvidia-ml-py 13's call
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
    assert xid_log["resolution"] == "reboot"


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
    assert gauges["gpu_temperature_celsius"] == 72.0
    assert gauges["gpu_healthy"] == 1.0


def test_pids_using_memory_lists_compute_processes(gpu: FakeGpu) -> None:
    gpu.process_pids = [[4242, 4243]]
    assert opened(gpu).pids_using_memory() == {4242, 4243}


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
    assert monitor.pids_using_memory() == set()
    monitor.close()


def test_a_driver_without_the_newer_temperature_call_is_asked_the_older_one(gpu: FakeGpu) -> None:
    gpu.fail["nvmlDeviceGetTemperatureV"] = NVMLError_FunctionNotFound
    assert opened(gpu).poll().temperature_c == 71
    assert "nvmlDeviceGetTemperature" in gpu.calls


def test_a_library_mismatch_on_the_process_listing_falls_back_to_the_v2_call(gpu: FakeGpu) -> None:
    """NVMLLibraryMismatchError is not an NVMLError: uncaught, it crashed the stop path."""
    gpu.driver_has_v3 = False
    gpu.process_pids = [[4242]]
    assert opened(gpu).pids_using_memory() == {4242}
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in gpu.calls


def test_a_refused_process_listing_is_none_not_an_empty_gpu(gpu: FakeGpu) -> None:
    """MIG as a user other than root: NVML refuses the listing; 'nobody holds memory' would
    make the release wait return at once."""
    gpu.fail["nvmlDeviceGetComputeRunningProcesses"] = NVMLError_NoPermission
    gpu.fail["nvmlDeviceGetComputeRunningProcesses_v2"] = NVMLError_NoPermission
    monitor = opened(gpu)
    assert monitor.pids_using_memory() is None
    assert monitor.memory_used_bytes() == 20 * GIB


def test_gpu_requires_reset_fails_naming_the_reset(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.fail["nvmlDeviceGetUtilizationRates"] = NVMLError_ResetRequired
    verdict = monitor.poll().verdict
    assert verdict.action == "fail"
    assert "nvidia-smi -r -i " + UUID in verdict.cause
    assert monitor.status == "unhealthy"
    assert monitor.verdict() == verdict


def test_a_row_remap_failure_fails_naming_the_reset(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.remapped_rows = (3, 1, 0, 1)  # (corrected, uncorrected, pending, failed)
    reading = monitor.poll()
    assert reading.row_remap_failed is True
    assert reading.verdict.action == "fail"
    assert "row remapping failed" in reading.verdict.cause and "reset the GPU" in reading.verdict.cause


@pytest.mark.parametrize(("xid", "action"), [
    (8, "restart_worker"), (94, "restart_worker"), (13, "restart_worker"),
    (63, "none"), (92, "none"), (45, "none"),
    (48, "fail"), (74, "fail"), (79, "fail"), (119, "fail"),
])
def test_each_xid_is_acted_on_by_its_catalog_class(gpu: FakeGpu, xid: int, action: str) -> None:
    monitor = opened(gpu)
    gpu.xid(xid)
    with capture_logs() as logs:
        verdict = monitor.poll().verdict
    assert verdict.action == action
    assert [e["xid"] for e in logs if e["event"] == "gpu.xid"] == [xid]
    assert monitor.summary()["last_xid"] == xid
    if action == "fail":
        assert ("reboot the machine" if xid == 79 else "nvidia-smi -r") in verdict.cause


def test_a_restart_verdict_is_given_once_and_is_not_sticky(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.xid(13)
    assert monitor.poll().verdict.action == "restart_worker"
    assert monitor.verdict().action == "none"  # asked between polls: the fault was reported


def test_settle_drains_an_ended_workers_xids_without_asking_again(gpu: FakeGpu) -> None:
    monitor = opened(gpu)
    gpu.xid(13)  # the worker's last fault, still queued as it died
    with capture_logs() as logs:
        assert monitor.settle().action == "none"
    assert [e["worker"] for e in logs if e["event"] == "gpu.xid"] == ["ended"]
    assert monitor.poll().verdict.action == "none"  # the next worker is not blamed for it
    gpu.xid(48)
    assert monitor.settle().action == "fail"  # a GPU that needs a reset stays failed


def test_a_compute_gpu_without_a_graphics_listing_still_lists_its_processes(gpu: FakeGpu) -> None:
    gpu.fail["nvmlDeviceGetGraphicsRunningProcesses"] = NVMLError_NotSupported
    gpu.fail["nvmlDeviceGetGraphicsRunningProcesses_v2"] = NVMLError_NotSupported
    gpu.process_pids = [[4242]]
    assert opened(gpu).pids_using_memory() == {4242}
