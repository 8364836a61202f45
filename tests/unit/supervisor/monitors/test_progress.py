"""Hang verdicts from the engine's own progress, on a fake clock: fast when the engine stops
running, never for a long prefill that burns CPU, the idle canary when there is no work."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.core.sections import SupervisorSettings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.stats import EngineStats
from supervisor.monitors.activity import Activity
from supervisor.monitors.progress import ProgressMonitor, WorkerDemand
from supervisor.monitors.stillness import Stillness
from tests.unit.supervisor.monitors.clock import Clock

pytestmark = pytest.mark.anyio


@dataclass
class Engine:
    """The worker as the monitor sees it: its /metrics, its canary, its CPU time."""

    busy: bool = False
    iterations: int = 0
    cpu: float | None = 0.0  # None: the process set changed
    runnable: int = 0  # threads running or waiting for a core
    answers_metrics: bool = True
    decodes: bool = True
    canaries: int = 0
    reads: int = 0  # of /metrics
    thread_reads: int = 0  # of the threads' states

    async def engine_stats(self) -> EngineStats | None:
        self.reads += 1
        if not self.answers_metrics:
            return None
        return EngineStats(running=1.0 if self.busy else 0.0, iterations=float(self.iterations))

    async def canary(self, timeout_s: float) -> bool:
        self.canaries += 1
        self.iterations += 1  # one step, as the real canary's token
        return self.decodes

    def activity(self, threads: bool) -> Activity | None:
        if self.cpu is None:
            return None
        self.thread_reads += threads
        return Activity(self.cpu, self.runnable if threads else 0)


@dataclass
class Server:
    """The worker's API server: a frozen one answers nothing, each question then costing the
    probe's full timeout on the clock, and its CPU time stands still."""

    clock: Clock
    frozen: bool = False
    cpu: float = 0.0
    cpu_per_question: float = 0.0

    def asked(self, engine: Engine) -> Engine:
        original = engine.engine_stats

        async def engine_stats() -> EngineStats | None:
            stats = await original()
            if stats is None:
                self.clock.now += SETTINGS.health_timeout_s
            self.cpu += self.cpu_per_question
            return stats

        engine.engine_stats = engine_stats  # type: ignore[method-assign]
        return engine

    def activity(self) -> Activity:
        return Activity(self.cpu, 0 if self.frozen or not self.cpu_per_question else 1)


SETTINGS = SupervisorSettings(progress_interval_s=1, hang_stall_s=5, hang_cpu_floor=0.02,
                              hang_busy_floor_s=120, canary_interval_s=30, canary_timeout_s=3)


def monitor(engine: Engine, clock: Clock, settings: SupervisorSettings = SETTINGS,
            demand: list[int] | None = None) -> ProgressMonitor:
    """`demand`: [in flight, admitted so far(, with no byte of their answer yet)], as the API's
    admission tells them."""
    return ProgressMonitor(engine, settings, clock=clock,
                           demand=None if demand is None else lambda: WorkerDemand(*demand),
                           activity=lambda _, threads: engine.activity(threads))


async def run_for(seconds: float, mon: ProgressMonitor, engine: Engine, clock: Clock,
                  *, cpu_per_s: float = 0.0, steps_per_s: int = 0) -> tuple[float, ExitCause | None]:
    """Tick once a second as the manager does; the verdict and when it came, or None.
    An engine using CPU shows a runnable thread in each sample."""
    start = clock.now
    while clock.now - start < seconds:
        clock.now += 1
        engine.runnable = 1 if cpu_per_s else 0
        if engine.cpu is not None:
            engine.cpu += cpu_per_s
        engine.iterations += steps_per_s
        cause = await mon.check(object())  # type: ignore[arg-type]
        if cause is not None:
            return clock.now - start, cause
    return seconds, None


async def test_a_busy_engine_that_stops_running_is_hung_within_the_stall_window() -> None:
    engine, clock = Engine(busy=True), Clock()
    mon = monitor(engine, clock)
    await run_for(3, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)  # decoding
    after, cause = await run_for(60, mon, engine, clock)  # SIGSTOP: no step, no CPU
    assert cause is not None and cause.reason is ExitReason.HUNG
    assert "not running" in cause.detail
    assert 5 <= after <= 7


async def test_a_long_prefill_burning_cpu_is_never_hung_before_the_busy_floor() -> None:
    engine, clock = Engine(busy=True), Clock()
    mon = monitor(engine, clock)
    _, cause = await run_for(110, mon, engine, clock, cpu_per_s=0.3)  # counters still
    assert cause is None


async def test_a_starved_engine_waiting_for_a_core_is_not_hung() -> None:
    """Five engines on two loaded cores: ours got 0.03 s of CPU in 5 s, but its threads were
    runnable: waiting for a core, not stopped."""
    engine, clock = Engine(busy=True), Clock()
    _, cause = await run_for(100, monitor(engine, clock), engine, clock, cpu_per_s=0.006)
    assert cause is None


async def test_a_deadlocked_engine_with_every_thread_asleep_is_hung() -> None:
    engine, clock = Engine(busy=True), Clock()
    mon = monitor(engine, clock)
    await run_for(3, mon, engine, clock, cpu_per_s=0.9, steps_per_s=1)
    after, cause = await run_for(30, mon, engine, clock)  # threads in futex waits: state S
    assert cause is not None and "not running" in cause.detail and after <= 7


async def test_busy_without_progress_past_three_times_the_longest_step_is_hung() -> None:
    engine, clock = Engine(busy=True), Clock()
    mon = monitor(engine, clock)
    await run_for(60, mon, engine, clock, cpu_per_s=1.0)  # a 60 s prefill...
    engine.iterations += 1  # ...that completed: the longest step seen is now 60 s
    await run_for(1, mon, engine, clock, cpu_per_s=1.0)
    assert mon.longest_step_s >= 60
    after, cause = await run_for(400, mon, engine, clock, cpu_per_s=1.0)  # a loop, no progress
    assert cause is not None and "over 3x the longest step" in cause.detail
    assert 180 <= after <= 182  # max(busy floor 120, 3 x 60)


async def test_an_unanswered_metrics_read_is_left_to_the_health_monitor() -> None:
    engine, clock = Engine(busy=True, answers_metrics=False), Clock()
    _, cause = await run_for(60, monitor(engine, clock), engine, clock)
    assert cause is None


async def test_an_idle_engine_gets_a_canary_each_interval_and_one_that_fails_is_hung() -> None:
    engine, clock = Engine(), Clock()
    mon = monitor(engine, clock)
    _, cause = await run_for(65, mon, engine, clock)
    assert cause is None and engine.canaries == 2
    engine.decodes = False
    after, cause = await run_for(60, mon, engine, clock)
    assert cause is not None and cause.reason is ExitReason.HUNG and "canary" in cause.detail
    assert after <= 30


async def test_a_slow_canary_from_a_starved_but_running_engine_is_not_a_hang() -> None:
    engine, clock = Engine(decodes=False), Clock()  # no answer in time, but it runs
    _, cause = await run_for(40, monitor(engine, clock), engine, clock, cpu_per_s=0.05)
    assert cause is None and engine.canaries >= 1


async def test_a_changed_process_set_is_not_read_as_an_idle_cpu() -> None:
    engine, clock = Engine(busy=True, cpu=None), Clock()  # the reader says: deltas would lie
    _, cause = await run_for(30, monitor(engine, clock), engine, clock)
    assert cause is None


async def test_an_idle_engine_is_read_again_only_once_a_request_is_admitted() -> None:
    engine, clock, demand = Engine(), Clock(), [0, 0]
    mon = monitor(engine, clock, demand=demand)
    await run_for(20, mon, engine, clock)
    assert engine.reads == 1  # one reading found it idle: nothing else makes it work
    demand[:] = [1, 1]
    engine.busy = True
    await run_for(5, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)
    assert engine.reads == 6  # each second while there is work
    demand[0] = 0
    engine.busy = False
    await run_for(5, mon, engine, clock)
    assert engine.reads == 7  # the reading that found it idle again, then none
    assert mon.stats is not None and not mon.stats.busy


async def test_a_request_come_and_gone_between_two_checks_is_still_read() -> None:
    engine, clock, demand = Engine(), Clock(), [0, 0]
    mon = monitor(engine, clock, demand=demand)
    await run_for(3, mon, engine, clock)
    demand[1] += 1  # admitted and answered within the second: its tokens moved the counters
    engine.iterations += 4
    await run_for(3, mon, engine, clock)
    assert engine.reads == 2 and mon.stats is not None and mon.stats.iterations == 4


async def test_the_idle_canary_still_runs_and_is_read_after() -> None:
    engine, clock, demand = Engine(), Clock(), [0, 0]
    mon = monitor(engine, clock, demand=demand)
    _, cause = await run_for(65, mon, engine, clock)
    assert cause is None and engine.canaries == 2
    assert engine.reads == 3  # the first, and one after each canary's token
    assert mon.stats is not None and mon.stats.iterations == 2
    engine.decodes = False
    _, cause = await run_for(40, mon, engine, clock)
    assert cause is not None and "canary" in cause.detail


async def test_a_prefill_after_a_long_quiet_spell_is_not_taken_for_a_stall() -> None:
    """Unread while idle for longer than the busy floor, then a long prefill: the stall is
    counted from the last idle second, not from the last reading."""
    engine, clock, demand = Engine(), Clock(), [0, 0]
    rare_canary = SETTINGS.model_copy(update={"canary_interval_s": 1000})  # no read after one
    mon = monitor(engine, clock, rare_canary, demand=demand)
    await run_for(400, mon, engine, clock)
    demand[:] = [1, 1]
    engine.busy = True
    _, cause = await run_for(100, mon, engine, clock, cpu_per_s=0.3)  # counters still
    assert cause is None


async def test_thread_states_are_read_only_while_the_counters_stand_still() -> None:
    engine, clock = Engine(busy=True), Clock()
    mon = monitor(engine, clock)
    await run_for(30, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)
    assert engine.thread_reads == 0
    after, cause = await run_for(30, mon, engine, clock)  # stopped
    assert engine.thread_reads == after
    assert cause is not None and "not running" in cause.detail and 5 <= after <= 7


async def test_an_engine_frozen_while_idle_is_hung_soon_after_a_request_waits_on_it() -> None:
    """EngineCore stopped while idle: its gauges stay "idle" (they come from its own stats), but
    the request the appliance sent it is work; no step and no CPU since: hung in seconds, not
    through the idle canary (47 s)."""
    engine, clock, demand = Engine(), Clock(), [0, 0]
    server = Server(clock)  # idle: it passed the request on and waits for EngineCore
    mon = ProgressMonitor(engine, SETTINGS, clock=clock, demand=lambda: WorkerDemand(*demand),
                          activity=lambda _, threads: engine.activity(threads),
                          server=lambda _, threads: server.activity())
    _, cause = await run_for(20, mon, engine, clock)  # idle, and frozen from here on
    assert cause is None
    demand[:] = [1, 1]  # a request arrives and waits for its head
    after, cause = await run_for(60, mon, engine, clock)
    assert cause is not None and cause.reason is ExitReason.HUNG and "not running" in cause.detail
    assert after <= 7 and engine.canaries == 0


async def test_a_request_sent_as_the_counters_moved_for_another_is_still_owed() -> None:
    """The held-out case again, with a twist measured on the real worker: a request is sent
    just as the engine finishes the one before (its last tokens move the counters after the
    send), then EngineCore stops before taking the new one. Its gauges say idle and nothing
    was sent since the last progress, but the request has had no byte of its answer: hung in
    seconds, not through the idle canary (16.5 s)."""
    engine, clock, demand = Engine(busy=True), Clock(), [1, 1, 0]
    mon = monitor(engine, clock, demand=demand)
    await run_for(5, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)
    demand[:] = [2, 2, 1]  # the next request is sent
    await run_for(1, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)  # the first one's last steps
    demand[:] = [1, 2, 1]  # the first is answered in full; the engine stops, idle by its gauges
    engine.busy = False
    after, cause = await run_for(60, mon, engine, clock)
    assert cause is not None and cause.reason is ExitReason.HUNG and "not running" in cause.detail
    assert after <= 7 and engine.canaries == 0


async def test_a_request_the_api_server_still_prepares_is_not_a_hung_engine() -> None:
    """A request only the appliance knows of, EngineCore idle: the server may still be
    tokenizing it or decoding its images, and uses CPU meanwhile."""
    engine, clock, demand = Engine(), Clock(), [0, 0]
    server = Server(clock, cpu_per_question=0.5)  # half a core, one read a second
    mon = ProgressMonitor(server.asked(engine), SETTINGS, clock=clock,
                          demand=lambda: WorkerDemand(*demand),
                          activity=lambda _, threads: engine.activity(threads),
                          server=lambda _, threads: server.activity())
    await run_for(5, mon, engine, clock)
    demand[:] = [1, 1]
    _, cause = await run_for(60, mon, engine, clock)
    assert cause is None


async def test_a_request_the_engine_already_answered_is_not_owed_work() -> None:
    """A stream whose slow client has not read the end yet: the engine finished it (its counters
    moved after it was sent) and is idle; that is not a stall."""
    engine, clock, demand = Engine(), Clock(), [0, 0]
    mon = monitor(engine, clock, demand=demand)
    await run_for(3, mon, engine, clock)
    demand[:] = [1, 1]
    engine.busy = True
    await run_for(5, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)
    engine.busy = False  # done, while the appliance still relays it
    _, cause = await run_for(100, mon, engine, clock)
    assert cause is None and engine.canaries >= 2  # the idle canary answers


async def test_a_long_prefill_of_a_waiting_request_is_not_hung() -> None:
    """An 8k prompt: no counter moves for tens of seconds, the gauges may not show it yet, but
    the engine burns CPU."""
    engine, clock, demand = Engine(), Clock(), [0, 0]
    mon = monitor(engine, clock, demand=demand)
    await run_for(5, mon, engine, clock)
    demand[:] = [1, 1]
    _, cause = await run_for(110, mon, engine, clock, cpu_per_s=0.9)
    assert cause is None


async def test_a_metrics_read_unanswered_with_requests_waiting_and_a_still_server_is_hung() -> None:
    """The API server frozen (SIGSTOP of the pid /health names) while the appliance has requests
    waiting on it: each /metrics read times out, and the server did not run meanwhile."""
    engine, clock, demand = Engine(busy=True), Clock(), [2, 2]
    server = Server(clock)
    mon = ProgressMonitor(server.asked(engine), SETTINGS, clock=clock,
                          demand=lambda: WorkerDemand(*demand),
                          activity=lambda _, threads: engine.activity(threads),
                          stillness=Stillness(SETTINGS, "/metrics", clock=clock,
                                              activity=lambda _, threads: server.activity()))
    await run_for(3, mon, engine, clock, cpu_per_s=0.9, steps_per_s=2)
    engine.answers_metrics, server.frozen = False, True
    start = clock.now
    cause = None
    while cause is None and clock.now - start < 60:
        clock.now += 1
        cause = await mon.check(object())  # type: ignore[arg-type]
    assert cause is not None and cause.reason is ExitReason.HUNG
    assert "did not answer /metrics" in cause.detail and "requests waiting on it (2)" in cause.detail
    assert clock.now - start <= 7


async def test_a_metrics_read_unanswered_by_a_running_server_is_not_hung() -> None:
    """A server starved of CPU still runs: no verdict from the progress watch."""
    engine, clock, demand = Engine(busy=True, answers_metrics=False), Clock(), [2, 2]
    server = Server(clock, cpu_per_question=0.2)
    mon = ProgressMonitor(server.asked(engine), SETTINGS, clock=clock,
                          demand=lambda: WorkerDemand(*demand),
                          activity=lambda _, threads: engine.activity(threads),
                          stillness=Stillness(SETTINGS, "/metrics", clock=clock,
                                              activity=lambda _, threads: server.activity()))
    _, cause = await run_for(60, mon, engine, clock)
    assert cause is None


def test_thread_states_are_read_from_proc_for_real_processes() -> None:
    """A spinning process has a runnable thread; the same process stopped, or a sleeping one,
    has none."""
    import signal
    import subprocess
    import sys
    import time

    from supervisor.monitors.activity import runnable_threads, thread_states

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while runnable_threads(spin.pid) == 0:  # it may wait for a core on a busy box
            assert time.monotonic() < deadline, "a spinning process was never seen runnable"
            time.sleep(0.05)
        deadline = time.monotonic() + 10  # once past its start-up, it only sleeps
        while runnable_threads(sleep.pid) != 0:
            assert time.monotonic() < deadline, "a sleeping process still looked runnable"
            time.sleep(0.05)
        assert thread_states(sleep.pid) == (0, False)  # asleep is not stopped
        spin.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while runnable_threads(spin.pid) != 0:
            assert time.monotonic() < deadline, "a stopped process still looked runnable"
            time.sleep(0.05)
        assert thread_states(spin.pid) == (0, True)
    finally:
        for proc in (spin, sleep):
            proc.kill()
            proc.wait()


def test_cpu_seconds_follow_the_process_and_end_with_it() -> None:
    """A spinning process's CPU time as /proc counts it (psutil's figure, to a clock tick),
    growing; None once the process is gone, from the kept descriptor as from a fresh one."""
    import subprocess
    import sys
    import time

    import psutil

    from supervisor.monitors.activity import cpu_seconds

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 20
        first = cpu_seconds(spin.pid)
        assert first is not None
        while (later := cpu_seconds(spin.pid)) is not None and later < first + 0.2:
            assert time.monotonic() < deadline, "a spinning process never used CPU"
            time.sleep(0.05)
        times = psutil.Process(spin.pid).cpu_times()
        now = cpu_seconds(spin.pid)
        assert now is not None and abs(now - (times.user + times.system)) <= 0.05
    finally:
        spin.kill()
        spin.wait()
    assert cpu_seconds(spin.pid) is None  # its kept descriptor: the process, not the pid
    assert cpu_seconds(spin.pid) is None  # and then a fresh open finds no such process


async def test_engine_activity_reads_the_child_processes_or_the_server_alone() -> None:
    """vLLM runs its engine in the server's children; a worker without children (a synthetic
    upstream) runs it in the server itself, which must then be what is read."""
    import asyncio
    import sys

    from appliance.core.sections import EngineSettings
    from supervisor.engine.worker import ProcessLauncher
    from supervisor.monitors.activity import EngineActivity

    spin = "while True: pass"
    sleeping_server = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                       f"{spin!r}]); time.sleep(600)")
    for code in (sleeping_server, spin):  # the spinning process: the child, then the server
        worker = await ProcessLauncher(EngineSettings(command=[sys.executable, "-c", code])).start()
        try:
            activity = EngineActivity()
            seen = None
            for _ in range(400):
                await asyncio.sleep(0.05)
                seen = activity(worker)
                if seen is not None and seen.runnable and seen.cpu_s >= 0.3:
                    break
            assert seen is not None and seen.runnable >= 1 and seen.cpu_s >= 0.3, (code, seen)
        finally:
            await worker.stop(grace_s=0)
