"""K consecutive failed /health probes: the worker's HTTP server is gone or wedged."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.worker import Worker

log = structlog.get_logger("supervisor.monitors.health")


class HealthProber(Protocol):
    async def healthy(self) -> bool: ...


class HealthMonitor:
    name = "health"

    def __init__(self, prober: HealthProber, *, interval_s: float, failures: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._prober = prober
        self._interval = interval_s
        self._limit = failures
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self._failures = 0
        self._due = self._clock()

    async def check(self, worker: Worker) -> ExitCause | None:
        if self._clock() < self._due:
            return None
        self._due = self._clock() + self._interval
        if await self._prober.healthy():
            self._failures = 0
            return None
        self._failures += 1
        log.warning("engine.probe_failed", consecutive=self._failures, limit=self._limit)
        if self._failures < self._limit:
            return None
        return ExitCause("running", ExitReason.UNHEALTHY,
                         f"{self._failures} consecutive /health failures")
