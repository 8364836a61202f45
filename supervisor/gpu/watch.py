"""The manager's view of the GPU: the NVML monitor polled off the loop at its own interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

from appliance.settings import GpuSettings
from supervisor.gpu.nvml import GpuMonitor

Action = Literal["none", "restart_worker", "fail"]


class GpuWatch:
    """Adapts GpuMonitor (blocking NVML calls) to the manager's async GpuWatch protocol."""

    def __init__(self, monitor: GpuMonitor, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._monitor = monitor
        self._interval = interval_s
        self._clock = clock
        self._last_poll = float("-inf")

    def summary(self) -> dict[str, Any]:
        return self._monitor.summary()

    def gauges(self) -> dict[str, float]:
        """Readings for Prometheus, by metric name without the appliance_ prefix."""
        return self._monitor.gauges()

    async def check(self) -> tuple[Action, str]:
        if not self._monitor.available:
            return "none", ""
        if self._clock() - self._last_poll >= self._interval:
            self._last_poll = self._clock()
            await asyncio.to_thread(self._monitor.poll)
        verdict = self._monitor.verdict()
        return verdict.action, verdict.cause

    async def wait_released(self, pids: set[int], timeout_s: float) -> bool:
        if not self._monitor.available:
            return True
        return await self._monitor.wait_released(pids, timeout_s)

    def close(self) -> None:
        self._monitor.close()


async def build_gpu_watch(settings: GpuSettings) -> GpuWatch | None:
    """None when the monitor is switched off; an 'unavailable' watch where NVML is absent."""
    if not settings.enabled:
        return None
    monitor = GpuMonitor(settings)
    await asyncio.to_thread(monitor.open)
    return GpuWatch(monitor, settings.poll_interval_s)
