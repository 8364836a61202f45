"""The engine state machine with fake workers, fake probes and a fake clock: no process, no sleep."""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from appliance.core.engine import EngineState, Waiting
from appliance.core.settings import Settings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.manager import EngineManager, Forensics
from supervisor.engine.sleep import SleepMode
from supervisor.engine.stats import EngineStats
from supervisor.engine.worker import StopReport, Worker
from supervisor.monitors import Monitor
from supervisor.monitors.activity import Activity
from supervisor.monitors.gpu import GpuHealthMonitor
from supervisor.monitors.health import HealthMonitor
from supervisor.monitors.progress import ProgressMonitor

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.now += delay
        await asyncio.sleep(0)


@dataclass
class FakeWorker:
    pid: int
    boots: bool = True  # answers /health and the canary once started
    healthy: bool = True
    decodes: bool = True
    returncode: int | None = None
    stopped_with: float | None = None
    busy: bool = False  # requests in the engine
    steps: int = 0  # the engine's progress counter
    cpu: float = 0.0  # CPU seconds its engine processes used: still when stopped or deadlocked
    last_cpu: float = 0.0
    tail: deque[str] = field(default_factory=deque)
    _exited: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def tree_pids(self) -> set[int]:
        return {self.pid, self.pid + 1}

    async def stop(self, grace_s: float) -> StopReport:
        self.stopped_with = grace_s
        if self.returncode is None:
            self.exit(-signal.SIGTERM)
        return StopReport(self.returncode, False, [])


class FakeLauncher:
    """Hands out workers made by `make` (default: a healthy one); remembers them all."""

    def __init__(self, make: Callable[[int], FakeWorker] | None = None) -> None:
        self.workers: list[FakeWorker] = []
        self._make = make or (lambda pid: FakeWorker(pid))

    async def start(self) -> FakeWorker:
        worker = self._make(100 + 10 * len(self.workers))
        self.workers.append(worker)
        return worker

    @property
    def current(self) -> FakeWorker:
        return self.workers[-1]


class FakeProber:
    def __init__(self, launcher: FakeLauncher) -> None:
        self._launcher = launcher
        self.canaries = 0

    def _live(self) -> FakeWorker | None:
        worker = self._launcher.current if self._launcher.workers else None
        return worker if worker is not None and worker.returncode is None else None

    async def healthy(self) -> bool:
        worker = self._live()
        return bool(worker and worker.boots and worker.healthy)

    async def serving(self) -> bool:
        return await self.healthy()

    async def canary(self, timeout_s: float) -> bool:
        self.canaries += 1
        worker = self._live()
        return bool(worker and worker.boots and worker.decodes)

    async def engine_stats(self) -> EngineStats | None:
        worker = self._live()
        if worker is None:
            return None
        return EngineStats(running=1.0 if worker.busy else 0.0, iterations=float(worker.steps))


def engine_activity(worker: Worker, threads: bool) -> Activity:
    """A fake engine whose CPU time the test drives; busy threads whenever it moved."""
    assert isinstance(worker, FakeWorker)
    runnable = int(worker.cpu != worker.last_cpu) if threads else 0
    worker.last_cpu = worker.cpu
    return Activity(worker.cpu, runnable)


def make_manager(launcher: FakeLauncher, clock: FakeClock, *, gpu: FakeGpu | None = None,
                 status: dict[str, float] | None = None, forensics: Forensics | None = None,
                 sleeper: SleepMode | None = None, **supervisor: float) -> EngineManager:
    settings = Settings(supervisor={"backoff_jitter": 0, "backoff_initial_s": 1,
                                    "backoff_max_s": 8, **supervisor}, status=status or {})
    prober, sup = FakeProber(launcher), settings.supervisor
    monitors: list[Monitor] = [
        HealthMonitor(prober, interval_s=sup.health_interval_s, failures=sup.health_failures,
                      clock=clock),
        ProgressMonitor(prober, sup, activity=engine_activity, clock=clock),
    ]
    if gpu is not None:
        monitors.append(GpuHealthMonitor(gpu))  # type: ignore[arg-type]
    return EngineManager(settings, launcher, prober, monitors, gpu=gpu,  # type: ignore[arg-type]
                         forensics=forensics, clock=clock, sleep=clock.sleep, rand=lambda: 0.5,
                         sleeper=sleeper)


async def until(condition: Callable[[], bool], turns: int = 5000) -> None:
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


async def test_healthy_worker_becomes_ready_and_stop_leaves_it_stopped() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    assert manager.pid == 100
    assert manager.snapshot()["state"] == "ready"
    manager.request_stop()
    await task
    assert manager.state is EngineState.STOPPED
    assert launcher.current.stopped_with == manager._sup.stop_grace_s
    assert manager.restarts == 0


async def test_crash_after_ready_is_seen_at_once_then_restarted() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_interval_s=30)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    lost: list[str] = []
    manager.on_lost(lambda: lost.append("lost"))
    causes: list[str] = []
    manager.listeners.append(lambda old, new, cause: causes.append(f"{new.value}: {cause}"))
    launcher.current.exit(-signal.SIGKILL)
    await until(lambda: bool(causes), turns=10)
    # The exit callback flips the state itself, not the next probe of the watch loop.
    assert causes[0].startswith("stopping: crashed after ready: SIGKILL")
    assert lost == ["lost"]
    await until(lambda: manager.state is EngineState.READY and manager.pid == 110)
    last = manager.snapshot()["last_exit"]
    assert (last["phase"], last["reason"]) == ("running", "exited")
    assert "SIGKILL" in last["detail"] and "crashed after ready" in last["detail"]
    assert manager.restarts == 1
    manager.request_stop()
    await task


async def test_boot_failure_is_told_apart_from_a_crash() -> None:
    clock = FakeClock()
    launcher = FakeLauncher(lambda pid: FakeWorker(pid, boots=pid != 100))
    manager = make_manager(launcher, clock)
    task = asyncio.create_task(manager.run())
    await until(lambda: len(launcher.workers) == 1)
    launcher.current.exit(1)
    await until(lambda: manager.state is EngineState.READY)
    assert manager.last_exit is not None
    assert manager.last_exit.phase == "boot"
    assert manager.last_exit.detail == "never became ready: exit 1"
    manager.request_stop()
    await task


async def test_startup_timeout_is_a_boot_failure() -> None:
    clock = FakeClock()
    launcher = FakeLauncher(lambda pid: FakeWorker(pid, boots=pid != 100))
    manager = make_manager(launcher, clock, startup_timeout_s=60)
    task = asyncio.create_task(manager.run())
    await until(lambda: len(launcher.workers) == 2)
    assert manager.last_exit is not None
    assert (manager.last_exit.phase, manager.last_exit.reason) == ("boot", "startup_timeout")
    assert launcher.workers[0].stopped_with is not None
    manager.request_stop()
    await task


async def test_backoff_doubles_between_restarts_and_is_capped() -> None:
    clock = FakeClock()
    launcher = FakeLauncher(lambda pid: FakeWorker(pid, boots=False))
    manager = make_manager(launcher, clock, crash_loop_restarts=50, startup_timeout_s=1,
                           health_interval_s=0.5)
    starts: list[float] = []
    manager.listeners.append(
        lambda old, new, cause: starts.append(clock.now) if new is EngineState.STARTING else None)
    task = asyncio.create_task(manager.run())
    await until(lambda: len(starts) >= 7)
    manager.request_stop()
    await task
    gaps = [round(b - a - 1.0, 3) for a, b in itertools.pairwise(starts)]
    assert gaps[:6] == [1, 2, 4, 8, 8, 8]  # each gap: 1 s of failed boot + the backoff delay


async def test_a_crash_after_ready_restarts_at_once_and_a_good_boot_resets_the_backoff() -> None:
    """Boots 100-120 fail (backoff 1, 2, 4), 130 serves and crashes: 140 starts with no delay;
    140 fails its boot: the delay is the first step again, not the fourth."""
    clock = FakeClock()
    launcher = FakeLauncher(lambda pid: FakeWorker(pid, boots=pid == 130))
    manager = make_manager(launcher, clock, crash_loop_restarts=50, startup_timeout_s=1,
                           health_interval_s=30)
    delays: list[str] = []
    manager.listeners.append(
        lambda old, new, cause: delays.append(cause.split()[2]) if new is EngineState.BACKOFF
        else None)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    launcher.current.exit(-signal.SIGKILL)
    await until(lambda: len(delays) >= 5)
    manager.request_stop()
    await task
    assert delays[:5] == ["1.0s", "2.0s", "4.0s", "0.0s", "1.0s"]


async def test_crash_loop_goes_failed_and_retries_once_the_window_passes() -> None:
    clock = FakeClock()
    launcher = FakeLauncher(lambda pid: FakeWorker(pid, boots=pid >= 130))
    manager = make_manager(launcher, clock, crash_loop_restarts=3, crash_loop_window_s=600,
                           startup_timeout_s=5)
    states: list[EngineState] = []
    manager.listeners.append(lambda old, new, cause: states.append(new))
    task = asyncio.create_task(manager.run())
    await until(lambda: EngineState.FAILED in states)
    failed_at = clock.now
    assert len(launcher.workers) == 3
    assert manager.retry_after_s() > 60
    await until(lambda: manager.state is EngineState.READY)
    assert clock.now - failed_at > 500  # held in failed until the oldest restart left the window
    manager.request_stop()
    await task


async def test_consecutive_health_failures_restart_the_worker() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_failures=3, canary_interval_s=10_000)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    launcher.current.healthy = False
    await until(lambda: manager.pid == 110 and manager.state is EngineState.READY)
    assert manager.last_exit is not None and manager.last_exit.reason == "unhealthy"
    assert launcher.workers[0].stopped_with is not None
    manager.request_stop()
    await task


async def test_the_cause_is_shown_while_the_worker_is_being_stopped() -> None:
    """A monitor's verdict is in /health at once, not only after the grace period."""
    clock, release = FakeClock(), asyncio.Event()

    class SlowToStop(FakeWorker):
        async def stop(self, grace_s: float) -> StopReport:
            await release.wait()
            return await super().stop(grace_s)

    launcher = FakeLauncher(lambda pid: SlowToStop(pid))
    manager = make_manager(launcher, clock, health_failures=1, canary_interval_s=10_000)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    launcher.current.healthy = False
    await until(lambda: manager.state is EngineState.STOPPING)
    snapshot = manager.snapshot()
    assert snapshot["last_exit"]["reason"] == "unhealthy"
    assert [e["reason"] for e in snapshot["recent_exits"]] == ["unhealthy"]
    release.set()
    await until(lambda: manager.pid == 110 and manager.state is EngineState.READY)
    assert len(manager.snapshot()["recent_exits"]) == 1
    manager.request_stop()
    await task


async def test_a_busy_engine_that_stops_running_is_declared_hung_and_restarted() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, hang_stall_s=5, canary_interval_s=10_000)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    launcher.current.busy = True  # and its CPU stands still, as under SIGSTOP; /health stays 200
    frozen_at = clock.now
    await until(lambda: manager.pid == 110)
    assert manager.last_exit is not None and manager.last_exit.reason == "hung"
    assert "not running" in manager.last_exit.detail
    assert clock.now - frozen_at <= 5 + 2  # the stall window plus a sampling interval or two
    manager.request_stop()
    await task


async def test_a_busy_engine_burning_cpu_without_progress_is_not_hung_for_a_long_prefill() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, hang_stall_s=5, hang_busy_floor_s=300,
                           canary_interval_s=10_000)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    worker = launcher.current
    worker.busy, worker.decodes = True, False  # a canary would queue behind the prefill
    start = clock.now
    while clock.now - start < 250:  # a 250 s prefill: counters still, CPU busy
        worker.cpu += 0.1
        await asyncio.sleep(0)
    assert manager.pid == 100 and manager.state is EngineState.READY
    manager.request_stop()
    await task


async def test_restart_timings_are_on_the_exit_and_reported_by_phase() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_interval_s=30)
    phases: dict[str, float] = {}
    manager.phase_listeners.append(lambda phase, seconds: phases.__setitem__(phase, seconds))
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    launcher.current.exit(-signal.SIGKILL)
    await until(lambda: manager.state is EngineState.READY and manager.pid == 110)
    restart = manager.snapshot()["last_exit"]["restart"]
    assert set(restart) == {"stop_s", "backoff_s", "boot_s", "total_s"}
    assert restart["backoff_s"] == 0.0  # it had been ready: restarted at once
    assert restart["total_s"] == pytest.approx(
        restart["stop_s"] + restart["backoff_s"] + restart["boot_s"])
    assert set(phases) == {"stop", "backoff", "boot", "total"}
    manager.request_stop()
    await task


async def test_recent_exits_keep_one_entry_per_worker_newest_first_with_timings() -> None:
    """The early record at the exit and the full one after the reap are one entry; the list
    is bounded by status.recent_exits."""
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_interval_s=30, status={"recent_exits": 2})
    task = asyncio.create_task(manager.run())
    for pid in (100, 110, 120):
        await until(lambda pid=pid: manager.state is EngineState.READY and manager.pid == pid)
        launcher.current.exit(-signal.SIGKILL if pid != 110 else 1)
    await until(lambda: manager.state is EngineState.READY and manager.pid == 130)
    exits = manager.snapshot()["recent_exits"]
    assert [e["detail"] for e in exits] == ["crashed after ready: SIGKILL (killed: out of memory, "
                                            "or an operator?)", "crashed after ready: exit 1"]
    assert all(set(e["restart"]) == {"stop_s", "backoff_s", "boot_s", "total_s"} for e in exits)
    assert exits[0] == manager.snapshot()["last_exit"]
    manager.request_stop()
    await task


class FakeGpu:
    """The manager's GPU view: a scripted verdict and a scripted memory release."""

    def __init__(self) -> None:
        self.action: str = "none"
        self.cause = ""
        self.releases = True
        self.unfit: str | None = None  # what settle() finds once a worker is gone
        self.waited_for: list[set[int]] = []
        self.log: list[str] = []  # new_worker, check, settle, in the order the manager called

    def new_worker(self) -> None:
        self.log.append("new_worker")

    async def settle(self) -> str | None:
        self.log.append("settle")
        return self.unfit

    def summary(self) -> dict[str, object]:
        return {"status": "ok", "health": self.action}

    async def check(self) -> tuple[str, str]:
        self.log.append("check")
        action, self.action = self.action, "none" if self.action == "restart_worker" else self.action
        return action, self.cause

    async def wait_released(self, pids: set[int], timeout_s: float) -> bool:
        self.waited_for.append(pids)
        return self.releases


GpuRun = tuple[FakeClock, FakeLauncher, FakeGpu, EngineManager]


@asynccontextmanager
async def running_with_a_gpu(launcher: FakeLauncher | None = None,
                             reached: EngineState = EngineState.READY) -> AsyncIterator[GpuRun]:
    """A manager with a scripted GPU, run until it is `reached`; stopped and awaited after.
    A failing test leaves it running, as it would without the helper."""
    clock, workers, gpu = FakeClock(), launcher or FakeLauncher(), FakeGpu()
    manager = make_manager(workers, clock, gpu=gpu)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is reached)
    yield clock, workers, gpu, manager
    manager.request_stop()
    await task


async def test_application_xid_restarts_the_worker_and_waits_for_its_memory() -> None:
    async with running_with_a_gpu() as (_clock, _launcher, gpu, manager):
        gpu.action, gpu.cause = "restart_worker", "xid 13 (graphics engine exception)"
        await until(lambda: manager.pid == 110 and manager.state is EngineState.READY)
        assert manager.last_exit is not None and manager.last_exit.reason == "gpu_app_error"
        assert gpu.waited_for[0] == {100, 101}  # the whole old tree, before the new start


async def test_lost_gpu_fails_for_good_without_a_restart_loop() -> None:
    async with running_with_a_gpu() as (clock, launcher, gpu, manager):
        gpu.action, gpu.cause = "fail", "GPU is lost"
        await until(lambda: manager.state is EngineState.FAILED)
        clock.now += 100_000
        for _ in range(200):
            await asyncio.sleep(0)
        assert manager.state is EngineState.FAILED and len(launcher.workers) == 1
        assert manager.snapshot()["last_exit"]["detail"] == "GPU is lost"


async def test_memory_still_held_after_stop_goes_failed_instead_of_starting() -> None:
    async with running_with_a_gpu() as (_clock, launcher, gpu, manager):
        gpu.releases = False
        launcher.current.exit(-signal.SIGKILL)
        await until(lambda: manager.state is EngineState.FAILED)
        assert len(launcher.workers) == 1
        assert "still hold GPU memory" in manager.snapshot()["last_exit"]["detail"]


@dataclass
class FakeForensics:
    """Records the order in which the manager calls the bundle hooks, and what it saw."""

    events: list[str] = field(default_factory=list)
    last: str | None = None
    waiting_at_loss: int | None = None
    manager: EngineManager | None = None

    def lost(self) -> None:
        if self.waiting_at_loss is None and self.manager is not None:
            self.waiting_at_loss = len(self.manager.waiting)
        self.events.append("lost")

    async def before_stop(self, worker: Worker, cause: ExitCause) -> None:
        assert worker.returncode is None or cause.reason is ExitReason.EXITED
        self.events.append(f"before_stop {cause.reason.value} alive={worker.returncode is None}")

    def stopped(self, worker: Worker, cause: ExitCause, stopped_in_s: float) -> None:
        self.events.append(f"stopped {cause.reason.value}")
        self.last = f"bundle-{worker.pid}"

    def recovered(self, cause: ExitCause) -> None:
        self.events.append(f"recovered total_s={cause.restart.get('total_s') is not None}")


async def test_a_hang_is_recorded_with_its_requests_its_live_processes_and_its_restart() -> None:
    clock, launcher, forensics = FakeClock(), FakeLauncher(), FakeForensics()
    manager = make_manager(launcher, clock, forensics=forensics)
    forensics.manager = manager
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    manager.waiting.add(object(), "req-1", object())  # type: ignore[arg-type]
    launcher.current.busy = True  # busy, then no step and no CPU: hung
    await until(lambda: manager.pid == 110 and manager.state is EngineState.READY, turns=50000)
    lost = forensics.events.index("lost")
    assert forensics.events[lost:] == ["lost", "before_stop hung alive=True", "stopped hung",
                                       "recovered total_s=True"]
    assert forensics.waiting_at_loss == 1  # described before any relay could end
    assert manager.snapshot()["last_crash"] == "bundle-100"
    manager.request_stop()
    await task


async def test_a_gpu_fault_during_boot_is_known_at_once_not_at_the_startup_timeout() -> None:
    never_boots = FakeLauncher(lambda pid: FakeWorker(pid, boots=False))
    booting = running_with_a_gpu(never_boots, EngineState.STARTING)
    async with booting as (clock, launcher, gpu, manager):
        gpu.action, gpu.cause = "restart_worker", "xid 13 (graphics engine exception): worker fault"
        await until(lambda: len(launcher.workers) == 2)
        first = manager.snapshot()["recent_exits"][-1]
        assert (first["phase"], first["reason"]) == ("boot", "gpu_app_error")
        assert clock.now - 1000.0 < Settings().supervisor.startup_timeout_s


def test_the_waiting_requests_the_monitors_read_are_the_ones_the_api_counts() -> None:
    """An empty Waiting is falsy (it has a length): the one given is kept all the same."""
    waiting = Waiting()
    settings = Settings()
    manager = EngineManager(settings, FakeLauncher(), FakeProber(FakeLauncher()), [],
                            waiting=waiting)  # type: ignore[arg-type]
    assert manager.waiting is waiting


async def test_an_ended_workers_last_xids_are_drained_before_the_next_worker_is_judged() -> None:
    async with running_with_a_gpu() as (_clock, launcher, gpu, manager):
        launcher.current.exit(-signal.SIGKILL)
        await until(lambda: manager.pid == 110 and manager.state is EngineState.READY)
        second_life = gpu.log[gpu.log.index("settle"):]
        assert second_life[:2] == ["settle", "new_worker"], \
            "drained, then the new worker is watched"


async def test_a_gpu_that_needs_a_reset_after_a_worker_ended_fails_naming_the_action() -> None:
    async with running_with_a_gpu() as (_clock, launcher, gpu, manager):
        gpu.unfit = ("xid 48 (double-bit ECC error): GPU unhealthy; stop chat-appliance, "
                     "reset the GPU")
        launcher.current.exit(-signal.SIGKILL)
        await until(lambda: manager.state is EngineState.FAILED)
        assert len(launcher.workers) == 1
        last = manager.snapshot()["last_exit"]
        assert last["reason"] == "gpu_fatal" and "reset the GPU" in last["detail"]


async def test_a_worker_answers_while_it_serves_and_never_once_declared_lost() -> None:
    """What the relay asks after a failed exchange (EngineView.answers): a worker that serves
    and passes its probe answers; one that failed its probe, one declared lost (a hung engine's
    /health still says 200 while its stacks are taken), or an older one does not."""
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_interval_s=30)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    serial = manager.serial
    assert await manager.answers(serial) and not await manager.answers(serial - 1)
    launcher.current.healthy = False
    assert not await manager.answers(serial)
    launcher.current.healthy = True
    manager._fire_lost()  # declared lost (as a hang verdict does), its state not yet changed
    assert manager.state is EngineState.READY and not await manager.answers(serial)
    manager.request_stop()
    await task


async def test_a_drain_holds_through_a_restart_the_new_worker_never_reads_ready() -> None:
    """A box drained while its worker restarts must not come back into a router's rotation
    when the new worker boots: it stays draining until it stops."""
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock, health_interval_s=30)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    manager.begin_drain()
    assert manager.state is EngineState.DRAINING
    states: list[EngineState] = []
    manager.listeners.append(lambda old, new, cause: states.append(new))
    launcher.current.exit(-signal.SIGKILL)
    await until(lambda: manager.pid == 110 and manager.state is EngineState.DRAINING)
    assert EngineState.READY not in states
    manager.request_stop()
    await task
    assert manager.state is EngineState.STOPPED


async def test_unload_stops_the_worker_without_a_restart_and_load_starts_one() -> None:
    """Residency's unload is no fault: no restart counted, no backoff, state unloaded until
    load() starts a fresh worker."""
    clock, launcher = FakeClock(), FakeLauncher()
    manager = make_manager(launcher, clock)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.READY)
    lost: list[str] = []
    manager.on_lost(lambda: lost.append("lost"))
    manager.unload()
    await until(lambda: manager.state is EngineState.UNLOADED)
    assert launcher.current.stopped_with == manager._sup.stop_grace_s and lost == ["lost"]
    assert (manager.restarts, manager.pid is None or manager.pid == 100) == (0, True)
    assert manager.snapshot()["last_exit"]["reason"] == "unloaded"
    assert len(launcher.workers) == 1  # nothing started while unloaded
    manager.load()
    await until(lambda: manager.state is EngineState.READY and manager.pid == 110)
    assert manager.restarts == 0
    manager.request_stop()
    await task


async def test_a_model_not_loaded_at_start_waits_for_its_load() -> None:
    clock, launcher = FakeClock(), FakeLauncher()
    settings = Settings(supervisor={"backoff_jitter": 0})
    prober = FakeProber(launcher)
    manager = EngineManager(settings, launcher, prober, [], clock=clock,  # type: ignore[arg-type]
                            sleep=clock.sleep, loaded=False)
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.state is EngineState.UNLOADED)
    assert launcher.workers == []
    manager.load()
    await until(lambda: manager.state is EngineState.READY)
    manager.request_stop()
    await task
