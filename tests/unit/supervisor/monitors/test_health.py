"""/health probes: K failures declare the worker dead; a server that neither answers nor runs
for the stall window is declared hung after the first timeout, one that is slow is not."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.core.sections import SupervisorSettings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.monitors.activity import Activity
from supervisor.monitors.health import HealthMonitor
from supervisor.monitors.stillness import Stillness
from tests.unit.supervisor.monitors.clock import Clock

pytestmark = pytest.mark.anyio

SETTINGS = SupervisorSettings(health_interval_s=2, health_timeout_s=5, health_failures=3,
                              hang_stall_s=5, hang_cpu_floor=0.02)


@dataclass
class Server:
    """The worker's API server on a fake clock: an unanswered probe costs its full timeout."""

    clock: Clock
    answers: bool = True
    quick_refusal: bool = False  # fails at once (a 503, a refused connection): an answer
    cpu: float = 0.0
    cpu_per_s: float = 0.0  # while not answering
    runnable: int = 0
    stopped: bool = False  # every thread in state T
    last_burst: float = 0.0  # CPU it used after the question came and before it stopped

    async def healthy(self) -> bool:
        if self.answers:
            return True
        if not self.quick_refusal:
            self.clock.now += SETTINGS.health_timeout_s
            self.cpu += self.cpu_per_s * SETTINGS.health_timeout_s + self.last_burst
            self.last_burst = 0.0
        return False

    def activity(self, threads: bool) -> Activity:
        return Activity(self.cpu, self.runnable if threads else 0, threads and self.stopped)


def health(server: Server, clock: Clock, stillness: bool = True) -> HealthMonitor:
    still = Stillness(SETTINGS, "/health", clock=clock,
                      activity=lambda _, threads: server.activity(threads)) if stillness else None
    return HealthMonitor(server, interval_s=SETTINGS.health_interval_s,
                         failures=SETTINGS.health_failures, stillness=still, clock=clock)


async def run_for(seconds: float, mon: HealthMonitor, clock: Clock) -> tuple[float, ExitCause | None]:
    start = clock.now
    while clock.now - start < seconds:
        clock.now += 1
        cause = await mon.check(object())  # type: ignore[arg-type]
        if cause is not None:
            return clock.now - start, cause
    return seconds, None


async def test_a_stopped_server_is_hung_after_its_first_unanswered_probe() -> None:
    """SIGSTOP of the API server, idle or not: no answer and no CPU for 5 s is a stopped
    server, not three probes 11 s apart."""
    clock = Clock()
    server = Server(clock)
    mon = health(server, clock)
    await run_for(6, mon, clock)
    server.answers = False
    after, cause = await run_for(60, mon, clock)
    assert cause is not None and cause.reason is ExitReason.HUNG
    assert "did not answer /health" in cause.detail and "not running" in cause.detail
    assert after <= 8


async def test_a_server_stopped_mid_stream_is_hung_at_its_first_unanswered_probe() -> None:
    """Measured on the real worker: a server busy streaming, stopped just after a probe came,
    used 0.3 s of CPU in its last moments. Judged by CPU alone, that put the verdict off by a
    whole probe (12 s); a process whose every thread is stopped will not run again."""
    clock = Clock()
    server = Server(clock)
    mon = health(server, clock)
    await run_for(6, mon, clock)
    server.answers, server.stopped, server.last_burst = False, True, 0.3
    after, cause = await run_for(60, mon, clock)
    assert cause is not None and cause.reason is ExitReason.HUNG and "is stopped" in cause.detail
    assert after <= 8


async def test_a_slow_server_that_runs_is_left_to_the_failure_count() -> None:
    clock = Clock()
    server = Server(clock, cpu_per_s=0.5, runnable=1)
    mon = health(server, clock)
    server.answers = False
    _, cause = await run_for(60, mon, clock)
    assert cause is not None and cause.reason is ExitReason.UNHEALTHY
    assert "3 consecutive" in cause.detail


async def test_a_quick_failure_is_an_answer_not_silence() -> None:
    """vLLM's /health answers 503 at once when its engine died: the count decides, since a
    server that answers quickly uses next to no CPU."""
    clock = Clock()
    server = Server(clock, quick_refusal=True)
    mon = health(server, clock)
    server.answers = False
    after, cause = await run_for(60, mon, clock)
    assert cause is not None and cause.reason is ExitReason.UNHEALTHY and after >= 5


async def test_without_stillness_only_the_failure_count_declares() -> None:
    clock = Clock()
    server = Server(clock)
    mon = health(server, clock, stillness=False)
    server.answers = False
    _, cause = await run_for(60, mon, clock)
    assert cause is not None and cause.reason is ExitReason.UNHEALTHY


async def test_an_answer_clears_the_silence() -> None:
    """Silent for a while, then answering: a later timeout starts a new window."""
    clock = Clock()
    server = Server(clock)
    still = Stillness(SETTINGS, "/health", clock=clock, activity=lambda _, t: server.activity(t))
    still.asking(object())  # type: ignore[arg-type]
    clock.now += 3
    assert still.unanswered(object()) is None  # type: ignore[arg-type]  # 3 s: a quick failure
    still.asking(object())  # type: ignore[arg-type]
    clock.now += 5
    server.cpu += 0.5  # it ran: not stopped
    assert still.unanswered(object()) is None  # type: ignore[arg-type]
    still.answered()
    still.asking(object())  # type: ignore[arg-type]
    clock.now += 5
    cause = still.unanswered(object())  # type: ignore[arg-type]
    assert cause is not None and "5.0s" in cause.detail
