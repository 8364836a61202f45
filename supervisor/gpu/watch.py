"""The manager's view of the GPU: the NVML monitor, every call of it off the event loop.

Xids are attributed to workers by time (see supervisor/gpu/nvml.py): `settle()` after a worker
is gone drains its last Xids; the first `check()` for a new worker drains again before judging
anything, as the ended worker's (a worker that has just been spawned has not touched the GPU
yet); from then on a poll's restart verdict is returned once, by the poll that found it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

from appliance.core.sections import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.readings import GpuVerdict
from supervisor.gpu.release import NvmlTimeout, ReleaseWait, off_loop

Action = Literal["none", "restart_worker", "fail"]


class GpuWatch:
    """Adapts GpuMonitor (blocking NVML calls) to the manager's async GpuWatch protocol."""

    def __init__(self, monitor: GpuMonitor, settings: GpuSettings, release: ReleaseWait,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._monitor = monitor
        self._interval = settings.poll_interval_s
        self._call_timeout = settings.call_timeout_s
        self._release = release
        self._clock = clock
        self._last_poll = float("-inf")
        self._new_worker = False

    @property
    def uuid(self) -> str | None:
        return self._monitor.uuid

    def summary(self) -> dict[str, Any]:
        return self._monitor.summary()

    def gauges(self) -> dict[str, float]:
        """Readings for Prometheus, by metric name without the appliance_ prefix."""
        return self._monitor.gauges()

    def new_worker(self) -> None:
        """A worker was just spawned: the next check drains before it judges."""
        self._new_worker = True

    async def check(self) -> tuple[Action, str]:
        if not self._monitor.available:
            return "none", ""
        verdict = self._monitor.verdict()
        if self._new_worker or self._clock() - self._last_poll >= self._interval:
            settle, self._new_worker = self._new_worker, False
            self._last_poll = self._clock()
            verdict = await self._poll(settle)
        return verdict.action, verdict.cause

    async def settle(self) -> str | None:
        """A worker is gone: its last Xids drained; why no new worker may start, or None."""
        if not self._monitor.available:
            return None
        verdict = await self._poll(settle=True)
        return verdict.cause if verdict.action == "fail" else None

    async def wait_released(self, pids: set[int], timeout_s: float) -> bool:
        if not self._monitor.available:
            return True
        return await self._release.wait(pids, timeout_s)

    async def aclose(self) -> None:
        try:
            await off_loop(self._monitor.close, self._call_timeout)
        except NvmlTimeout:
            return  # exiting anyway: the process's end closes NVML

    async def _poll(self, settle: bool) -> GpuVerdict:
        call = self._monitor.settle if settle else (lambda: self._monitor.poll().verdict)
        try:
            return await off_loop(call, self._call_timeout)
        except NvmlTimeout:
            return self._monitor.verdict()


async def build_gpu_watch(settings: GpuSettings) -> GpuWatch | None:
    """None when the monitor is switched off; an 'unavailable' watch where NVML is absent."""
    if not settings.enabled:
        return None
    monitor = GpuMonitor(settings)
    # Timed out: never opened, the watch stays 'unavailable' and the worker runs unwatched.
    with contextlib.suppress(NvmlTimeout):
        await off_loop(monitor.open, settings.call_timeout_s)
    release = ReleaseWait(monitor, settings.release_slack_mib)
    if monitor.available:
        await release.note_idle(settings.call_timeout_s)
    return GpuWatch(monitor, settings, release)
