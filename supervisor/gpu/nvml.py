"""NVML GPU monitor: Xid and lost-GPU verdicts, telemetry, and which PIDs hold GPU memory.

Every NVML call goes through one injected module object (`pynvml`), so a fake drives the
tests. Without NVML (no driver: a laptop, CI) the monitor is "unavailable" and answers empty.
Threads: every method that calls NVML blocks (a sick GPU's calls can take seconds) and is run
off the event loop by supervisor/gpu/watch.py; the loop only reads `verdict()`, `summary()` and
`gauges()`; state crosses threads only as whole-object assignments.

Xids carry no PID, so they are attributed by time: `poll()` judges what it drains as the
running worker's; `settle()`, run once a worker is gone and before its successor is judged,
drains what is left as the ended worker's (a restart-class Xid then asks for nothing more).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, replace
from types import ModuleType
from typing import Any, Protocol

import structlog

from supervisor.gpu.readings import GpuReading, GpuVerdict, Status
from supervisor.gpu.xids import OPERATOR_ACTIONS, Resolution, classify_xid

log = structlog.get_logger(__name__)


# Query label → (NVML functions, the first one this NVML has wins; arguments after the handle).
_QUERIES: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "memory": (("nvmlDeviceGetMemoryInfo",), ()),
    "utilization": (("nvmlDeviceGetUtilizationRates",), ()),
    "temperature": (("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), (0,)),  # GPU die
    "clock_event_reasons": (
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        (),
    ),
    "ecc": (("nvmlDeviceGetTotalEccErrors",), (1, 0)),  # uncorrected, volatile (since boot)
    "retired_pages": (("nvmlDeviceGetRetiredPagesPendingStatus",), ()),
    "row_remap": (("nvmlDeviceGetRemappedRows",), ()),  # (corrected, uncorrected, pending, failed)
    # The unversioned call is _v3, which an older driver lacks (NVMLLibraryMismatchError).
    "compute_processes": (
        ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
        (),
    ),
    "graphics_processes": (
        ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
        (),
    ),
}
_MAX_EVENTS_PER_POLL = 64
_LOST = "NVMLError_GpuIsLost"  # NVML_ERROR_GPU_IS_LOST, as pynvml names its class
_RESET_REQUIRED = "NVMLError_ResetRequired"  # NVML_ERROR_RESET_REQUIRED: "GPU requires reset"
# Not an NVMLError: nvidia-ml-py raises it for an unversioned call this NVML library lacks.
_MISMATCH = "NVMLLibraryMismatchError"
_ABSENT_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
# Logged once, then that query is skipped: the GPU, the driver or our privileges lack it
# (under MIG a user other than root may not list processes: NoPermission).
_UNSUPPORTED_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_NoPermission",
    _MISMATCH,
)


class _Fatal(Exception):
    """NVML answered GPU_IS_LOST or RESET_REQUIRED: no query of this GPU is worth more."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class MonitorSettings(Protocol):
    """What the monitor reads of its settings: the appliance's `gpu` section (GpuSettings), or
    the GPU smoke check's own, which runs where pydantic is not installed."""

    @property
    def enabled(self) -> bool: ...

    @property
    def device(self) -> str: ...


class GpuMonitor:
    """Watches one GPU through NVML; see the module docstring for the threading contract."""

    def __init__(self, settings: MonitorSettings, nvml: ModuleType | None = None) -> None:
        self._settings = settings
        self._nvml: Any = nvml  # pynvml has no type hints: its attributes are Any anyway
        self._status: Status = "unavailable" if settings.enabled else "disabled"
        self._initialized = False
        self._handle: Any = None
        self._event_set: Any = None
        self._name: str | None = None
        self._uuid: str | None = None
        self._last = GpuReading()
        self._failure: GpuVerdict | None = None  # sticky: a lost or unhealthy GPU stays so
        self._last_xid: int | None = None
        self._xid_total = 0
        self._unsupported: set[str] = set()

    @property
    def status(self) -> Status:
        return self._status

    @property
    def available(self) -> bool:
        """NVML is open on the device: status ok, unhealthy or lost (until `close()`)."""
        return self._initialized and self._status in ("ok", "unhealthy", "lost")

    @property
    def uuid(self) -> str | None:
        return self._uuid

    @property
    def events_supported(self) -> bool:
        return self._event_set is not None

    def open(self) -> None:
        """Initialise NVML, find the device, subscribe to Xid events; never raises."""
        if not self._settings.enabled:
            log.info("gpu.disabled")
            return
        if not self._init():
            return
        nvml = self._nvml
        try:
            self._handle = self._find_device()
            self._name = _text(nvml.nvmlDeviceGetName(self._handle))
            self._uuid = _text(nvml.nvmlDeviceGetUUID(self._handle))
        except nvml.NVMLError as exc:
            self._device_failed(exc)
            return
        self._status = "ok"
        self._register_events()
        log.info("gpu.opened", name=self._name, uuid=self._uuid, xid_events=self.events_supported)

    def poll(self) -> GpuReading:
        """Read telemetry and drain Xid events (non-blocking) as the running worker's; the
        reading's verdict is for this poll only (a restart is asked for once), `verdict()` keeps
        what is sticky."""
        return self._poll(worker_gone=False)

    def settle(self) -> GpuVerdict:
        """A worker has ended: drain what Xids are left as that worker's. Its restart-class
        Xids ask for nothing more (it is gone); a reset or reboot class still fails."""
        self._poll(worker_gone=True)
        return self.verdict()

    def verdict(self) -> GpuVerdict:
        """What stays true between polls: a lost GPU, or one that needs a reset or reboot."""
        return self._failure or GpuVerdict()

    def pids_using_memory(self) -> set[int] | None:
        """PIDs (as the host numbers them) of compute and graphics processes holding memory
        on this GPU; None where NVML will not list them (MIG without root, an old driver)."""
        if not self._can_query():
            return set()
        pids: set[int] = set()
        try:
            for label in ("compute_processes", "graphics_processes"):
                processes = self._query(label)
                if label == "compute_processes" and label in self._unsupported:
                    return None  # graphics processes alone may be unsupported (a compute GPU)
                pids.update(int(process.pid) for process in processes or ())
        except _Fatal as exc:
            self._mark_failed(exc.error, during="pids_using_memory")
            return set()
        return pids

    def memory_used_bytes(self) -> int | None:
        """Used memory of the whole GPU now; None where NVML cannot say."""
        if not self._can_query():
            return None
        try:
            memory = self._query("memory")
        except _Fatal as exc:
            self._mark_failed(exc.error, during="memory_used_bytes")
            return None
        return None if memory is None else int(memory.used)

    def summary(self) -> dict[str, Any]:
        """The GPU part of /health's JSON."""
        if self._status in ("disabled", "unavailable"):
            return {"status": self._status}
        reading = self._last
        return {
            "status": self._status,
            "name": self._name,
            "uuid": self._uuid,
            **{key: value for key, value in asdict(reading).items() if key != "verdict"},
            "thermal_slowdown": reading.thermal_slowdown,
            "power_slowdown": reading.power_slowdown,
            "slowdown_reasons": list(reading.slowdown_reasons),
            "warnings": list(reading.warnings),
            "xid_events": "subscribed" if self.events_supported else "unsupported",
            "last_xid": self._last_xid,
            "health": asdict(self.verdict()),
        }

    def gauges(self) -> dict[str, float]:
        """Metric name → value for Prometheus; a query NVML cannot answer is left out."""
        values: dict[str, float] = {"gpu_up": 1.0 if self._can_query() else 0.0}
        if self._status in ("disabled", "unavailable"):
            return values
        reading = self._last
        optional = {
            "gpu_memory_used_bytes": reading.memory_used_bytes,
            "gpu_memory_total_bytes": reading.memory_total_bytes,
            "gpu_utilization_percent": reading.utilization_pct,
            "gpu_temperature_celsius": reading.temperature_c,
            "gpu_ecc_uncorrected_volatile_errors": reading.ecc_uncorrected_volatile,
        }
        values.update({key: float(value) for key, value in optional.items() if value is not None})
        values["gpu_healthy"] = 1.0 if self.verdict().action == "none" else 0.0
        values["gpu_thermal_slowdown"] = float(reading.thermal_slowdown)
        values["gpu_power_slowdown"] = float(reading.power_slowdown)
        values["gpu_xid_events_total"] = float(self._xid_total)
        return values

    def close(self) -> None:
        """Free the event set and shut NVML down; errors are logged, never raised."""
        if self._nvml is None:
            return
        if self._event_set is not None:
            self._quietly("nvmlEventSetFree", self._event_set)
            self._event_set = None
        if self._initialized:
            self._quietly("nvmlShutdown")
            self._initialized = False
        self._handle = None

    def _init(self) -> bool:
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            log.info("gpu.unavailable", reason="pynvml is not installed", error=str(exc))
            return False
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            if self._is(exc, *_ABSENT_ERRORS):  # no NVIDIA driver here: normal, not an error
                log.info("gpu.unavailable", reason=str(exc))
            else:
                log.warning("gpu.unavailable", reason="nvmlInit failed", error=str(exc))
            return False
        self._initialized = True
        return True

    def _find_device(self) -> Any:
        device = self._settings.device.strip()
        if device.isdigit():
            return self._nvml.nvmlDeviceGetHandleByIndex(int(device))
        return self._nvml.nvmlDeviceGetHandleByUUID(device)

    def _device_failed(self, exc: BaseException) -> None:
        if self._is(exc, _LOST, _RESET_REQUIRED):
            self._status = "ok"  # found, and answering that it is broken: a sticky fail
            self._mark_failed(exc, during="open")
            return
        log.error("gpu.device_not_found", device=self._settings.device, error=str(exc))
        self._handle = None
        self._quietly("nvmlShutdown")
        self._initialized = False

    def _register_events(self) -> None:
        nvml, event_set = self._nvml, None
        try:
            event_set = nvml.nvmlEventSetCreate()
            mask = nvml.nvmlEventTypeXidCriticalError
            nvml.nvmlDeviceRegisterEvents(self._handle, mask, event_set)
        except nvml.NVMLError as exc:
            log.info("gpu.xid_events_unsupported", error=str(exc), mode="poll_only")
            if event_set is not None:
                self._quietly("nvmlEventSetFree", event_set)
            return
        self._event_set = event_set

    def _poll(self, *, worker_gone: bool) -> GpuReading:
        if not self._can_query():  # nothing new: only what is sticky stands
            return replace(self._last, verdict=self.verdict())
        try:
            reading = self._read(worker_gone=worker_gone)
        except _Fatal as exc:
            reading = GpuReading(verdict=self._mark_failed(exc.error, during="poll"))
        else:
            self._log_transitions(self._last, reading)
        self._last = reading
        return reading

    def _read(self, *, worker_gone: bool) -> GpuReading:
        labels = ("memory", "utilization", "temperature", "clock_event_reasons", "ecc")
        memory, utilization, temperature, reasons, ecc = (self._query(q) for q in labels)
        retired, remap = self._query("retired_pages"), self._query("row_remap")
        if remap is not None and remap[3]:  # the InfoROM could not record a remap
            self._fail("row remapping failed", "reset_gpu")
        xids = self._drain_xids()
        return GpuReading(
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_pct=None if utilization is None else int(utilization.gpu),
            temperature_c=None if temperature is None else int(temperature),
            clock_event_reasons=None if reasons is None else int(reasons),
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            retired_pages_pending=None if retired is None else bool(retired),
            row_remap_pending=None if remap is None else bool(remap[2]),
            row_remap_failed=None if remap is None else bool(remap[3]),
            xids=xids,
            verdict=self._judge(xids, worker_gone=worker_gone),
        )

    def _query(self, label: str) -> Any:
        """Ask NVML one of `_QUERIES`; None where the GPU or driver lacks it (logged once)."""
        if label in self._unsupported:
            return None
        names, args = _QUERIES[label]
        for function in (getattr(self._nvml, name) for name in names if hasattr(self._nvml, name)):
            try:
                return function(self._handle, *args)
            except self._errors as exc:
                self._raise_if_fatal(exc)
                if not self._is(exc, *_UNSUPPORTED_ERRORS):
                    log.warning("gpu.query_failed", query=label, error=str(exc))
                    return None
        self._unsupported.add(label)
        log.info("gpu.query_unsupported", query=label)
        return None

    def _drain_xids(self) -> tuple[int, ...]:
        if self._event_set is None:
            return ()
        nvml = self._nvml
        xids: list[int] = []
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except self._errors as exc:
                self._raise_if_fatal(exc)
                if not self._is(exc, "NVMLError_Timeout"):  # Timeout: the queue is empty
                    log.warning("gpu.event_wait_failed", error=str(exc))
                break
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                xids.append(int(data.eventData))
        return tuple(xids)

    def _judge(self, xids: tuple[int, ...], *, worker_gone: bool) -> GpuVerdict:
        """Acts per the catalog's class: restart the running worker once, fail, or record."""
        restart: str | None = None
        for xid in xids:
            found = classify_xid(xid)
            self._last_xid = xid
            self._xid_total += 1
            level = log.warning if found.resolution == "informational" else log.error
            level("gpu.xid", xid=xid, name=found.name, resolution=found.resolution,
                  worker="ended" if worker_gone else "running", uuid=self._uuid)
            if found.resolution in OPERATOR_ACTIONS:
                self._fail(found.description, found.resolution)
            elif found.resolution == "restart_app" and not worker_gone and restart is None:
                restart = found.description + ": worker fault"
        if self._failure is not None:
            return self._failure
        return GpuVerdict("restart_worker", restart) if restart else GpuVerdict()

    def _fail(self, what: str, resolution: Resolution) -> None:
        """Sticky: the GPU needs an operator, and the cause says what they must do."""
        if self._failure is not None:
            return
        action = OPERATOR_ACTIONS[resolution].format(uuid=self._uuid or "<gpu>")
        self._failure = GpuVerdict("fail", f"{what}: GPU unhealthy; {action}")
        self._status = "unhealthy"
        log.error("gpu.unhealthy", cause=self._failure.cause, uuid=self._uuid)

    def _mark_failed(self, exc: BaseException, *, during: str) -> GpuVerdict:
        """NVML said the GPU is lost (reboot) or needs a reset."""
        if self._is(exc, _RESET_REQUIRED):
            self._fail(f"NVML: the GPU requires a reset ({exc})", "reset_gpu")
        else:
            if self._status != "lost":
                log.error("gpu.lost", during=during, error=str(exc), uuid=self._uuid)
            self._status = "lost"
            self._failure = GpuVerdict(
                "fail", "GPU lost (NVML_ERROR_GPU_IS_LOST); " + OPERATOR_ACTIONS["reboot"])
        return self.verdict()

    def _raise_if_fatal(self, exc: BaseException) -> None:
        if self._is(exc, _LOST, _RESET_REQUIRED):
            raise _Fatal(exc) from exc

    def _log_transitions(self, before: GpuReading, after: GpuReading) -> None:
        if after.thermal_slowdown and not before.thermal_slowdown:
            log.warning(
                "gpu.thermal_slowdown",
                temperature_c=after.temperature_c,
                reasons=list(after.slowdown_reasons),
            )
        elif before.thermal_slowdown and not after.thermal_slowdown:
            log.info("gpu.thermal_slowdown_cleared", temperature_c=after.temperature_c)
        for name in set(after.warnings) - set(before.warnings) - {"thermal_slowdown"}:
            log.warning("gpu.reset_pending", condition=name, uuid=self._uuid)

    @property
    def _errors(self) -> tuple[type[BaseException], ...]:
        """What an NVML call raises: NVMLError, and the version mismatch that is not one."""
        mismatch = getattr(self._nvml, _MISMATCH, None)
        return (self._nvml.NVMLError, *([mismatch] if isinstance(mismatch, type) else []))

    def _can_query(self) -> bool:
        return self._status in ("ok", "unhealthy") and self._handle is not None

    def _is(self, exc: BaseException, *class_names: str) -> bool:
        classes = tuple(getattr(self._nvml, name, None) for name in class_names)
        return any(isinstance(exc, cls) for cls in classes if isinstance(cls, type))

    def _quietly(self, name: str, *args: Any) -> None:
        nvml = self._nvml
        try:
            getattr(nvml, name)(*args)
        except nvml.NVMLError as exc:
            log.warning("gpu.cleanup_failed", call=name, error=str(exc))


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; releases before 11.5 returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)
