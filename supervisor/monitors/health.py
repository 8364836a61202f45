"""Failed /health probes: the worker's HTTP server is gone or wedged.

K consecutive failures declare it dead; sooner, with a Stillness, once it has neither answered
nor run for `hang_stall_s` (stopped, not slow)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.worker import Worker
from supervisor.monitors.stillness import Stillness

log = structlog.get_logger("supervisor.monitors.health")


class HealthProber(Protocol):
    async def healthy(self) -> bool: ...


class HealthMonitor:
    name = "health"

    def __init__(self, prober: HealthProber, *, interval_s: float, failures: int,
                 stillness: Stillness | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._prober = prober
        self._interval = interval_s
        self._limit = failures
        self._stillness = stillness
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self._failures = 0
        self._due = self._clock()
        if self._stillness is not None:
            self._stillness.reset()

    async def check(self, worker: Worker) -> ExitCause | None:
        if self._clock() < self._due:
            return None
        self._due = self._clock() + self._interval
        if self._stillness is not None:
            self._stillness.asking(worker)
        if await self._prober.healthy():
            self._failures = 0
            if self._stillness is not None:
                self._stillness.answered()
            return None
        self._failures += 1
        log.warning("engine.probe_failed", consecutive=self._failures, limit=self._limit)
        if self._failures < self._limit:
            return self._stillness.unanswered(worker) if self._stillness is not None else None
        return ExitCause("running", ExitReason.UNHEALTHY,
                         f"{self._failures} consecutive /health failures")
