"""The engine manager: spawn, watch, declare dead, stop, back off, restart; the state machine.

starting → ready → stopping → backoff → starting …, `failed` after a crash loop (N restarts in
a window) or a lost GPU, `draining` then `stopped` on shutdown, `unloaded` while residency
(supervisor.engine.residency) wants no worker, or `sleeping` where the model sleeps instead
(supervisor.engine.sleep). What declares a worker dead: its exit (seen at
once), or the first monitor (supervisor/monitors/) that returns a cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog

from appliance.core.engine import EngineState, Waiting
from appliance.core.settings import Settings
from supervisor.engine.backoff import Backoff, CrashLoop
from supervisor.engine.exits import ExitCause, ExitReason, Phase, process_exit
from supervisor.engine.parts import BootProber, Forensics, GpuMemory, Launcher
from supervisor.engine.resting import Resting
from supervisor.engine.sleep import SleepMode
from supervisor.engine.worker import Worker
from supervisor.monitors import Monitor

log = structlog.get_logger("supervisor.engine.manager")


Transition = Callable[[EngineState, EngineState, str], None]
PhaseTiming = Callable[[str, float], None]


class EngineManager(Resting):
    """Owns the worker's life; the API reads it through appliance.core.engine.EngineView."""

    def __init__(
        self,
        settings: Settings,
        launcher: Launcher,
        prober: BootProber,
        monitors: list[Monitor],
        *,
        gpu: GpuMemory | None = None,
        waiting: Waiting | None = None,
        forensics: Forensics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        loaded: bool = True,
        sleeper: SleepMode | None = None,
    ) -> None:
        self._settings = settings
        self._sup = sup = settings.supervisor
        self._launcher = launcher
        self._prober = prober
        self._monitors = monitors
        self._sleeper = sleeper  # residency's unload puts the worker to sleep (sleep mode)
        self.sleep_counts: Counter[str] = Counter()
        self._gpu = gpu
        self.waiting = Waiting() if waiting is None else waiting  # the API's requests (EngineView)
        self._forensics = forensics
        self._clock = clock
        self._sleep = sleep
        self._backoff = Backoff(sup.backoff_initial_s, sup.backoff_max_s, sup.backoff_jitter, rand)
        self._crash_loop = CrashLoop(sup.crash_loop_restarts, sup.crash_loop_window_s)
        self._state = EngineState.STOPPED
        self._worker: Worker | None = None
        self._lost_callbacks: dict[int, Callable[[], None]] = {}
        self._asking: asyncio.Future[bool] | None = None  # answers()' probe under way
        self._lost = 0  # the serial of the last worker declared lost
        self._next_subscription = 0
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # set, and replaced, at each change of state
        self._stop_requested = False
        # Residency wants a worker for this model (starting, serving or restarting), or none.
        self.loaded = loaded
        self._draining = False
        self._started_at = clock()
        self._ready_since: float | None = None
        self._last_exit: ExitCause | None = None
        # The last few workers' exits, newest last, each tagged with its worker's serial so
        # that the early record (at the exit itself) and the full one replace each other.
        self._exits: deque[tuple[int, ExitCause]] = deque(maxlen=settings.status.recent_exits)
        self._serial = 0  # counts workers started
        self._recovery: dict[str, float] | None = None  # clock marks of the restart under way
        self._retry_at: float | None = None
        self.restart_counts: Counter[str] = Counter()
        self.transition_counts: Counter[str] = Counter()
        self.last_tick = clock()  # the loop's heartbeat, for the systemd watchdog
        self.listeners: list[Transition] = []
        self.phase_listeners: list[PhaseTiming] = []
        # More facts for /health, each read when it is asked (the correctness canary's verdict).
        self.details: dict[str, Callable[[], object]] = {}

    # --- EngineView -------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    @property
    def base_url(self) -> str:
        return self._settings.engine.base_url

    @property
    def model_name(self) -> str:
        return self._settings.engine.model_name

    def retry_after_s(self) -> int:
        floor = self._settings.server.retry_after_s
        if self._retry_at is None:
            return floor
        return max(floor, min(600, round(self._retry_at - self._clock())))

    @property
    def serial(self) -> int:
        return self._serial

    async def changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    async def answers(self, serial: int) -> bool:
        # One probe at a time, shared: a worker that cuts every stream at once is asked once.
        if serial != self._serial or serial == self._lost or self._state is not EngineState.READY:
            return False
        if self._asking is None:
            self._asking = asking = asyncio.ensure_future(self._prober.healthy())
            asking.add_done_callback(self._asked)
        healthy = await asyncio.shield(self._asking)
        return healthy and serial == self._serial != self._lost \
            and self._state is EngineState.READY

    def _asked(self, asking: asyncio.Future[bool]) -> None:
        if self._asking is asking:
            self._asking = None

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        key = self._next_subscription
        self._next_subscription += 1
        self._lost_callbacks[key] = callback

        def unsubscribe() -> None:
            self._lost_callbacks.pop(key, None)

        return unsubscribe

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "state": self._state.value,
            "pid": self.pid,
            "model": self.model_name,
            "uptime_s": round(now - self._ready_since, 1) if self._ready_since else None,
            "supervisor_uptime_s": round(now - self._started_at, 1),
            "restarts": self.restarts,
            "last_exit": self._last_exit.as_dict() if self._last_exit else None,
            "recent_exits": [cause.as_dict() for _, cause in reversed(self._exits)],
            "gpu": self._gpu.summary() if self._gpu else {"status": "unavailable"},
            "last_crash": self._forensics.last if self._forensics else None,
        } | {name: read() for name, read in self.details.items()}

    # --- control ----------------------------------------------------------------------------

    @property
    def restarts(self) -> int:
        return sum(self.restart_counts.values())

    @property
    def last_exit(self) -> ExitCause | None:
        return self._last_exit

    def loop_is_turning(self) -> bool:
        """False once the manager has gone longer without a pass than any one step may take."""
        sup = self._sup
        longest_step = (2 * sup.health_timeout_s + sup.canary_timeout_s + sup.stop_grace_s
                        + sup.gpu_release_timeout_s + 30)
        return self._clock() - self.last_tick < max(longest_step, sup.health_interval_s * 3)

    def begin_drain(self) -> None:
        """Stop admitting: health and new requests answer 503 while in-flight ones finish; a
        worker that becomes ready after this (a drain during a restart) stays draining."""
        self._draining = True
        if self._state is EngineState.READY:
            self._set_state(EngineState.DRAINING, "shutdown requested")

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        self._stop_requested = True
        self._wake.set()
        self._pulse()

    def _pulse(self) -> None:
        """Wakes whoever waits in changed()."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Keep a worker serving until request_stop(); returns once the worker is stopped."""
        while not self._stop_requested:
            if not self.loaded:
                await self._hold_unloaded()
                continue
            if self._crash_loop.tripped(self._clock()):
                await self._hold_failed(self._crash_loop.clears_at())
                continue
            cause = await self._run_worker()
            if self.stop_requested:  # the property: a stop may come while the worker ran
                break
            if cause.reason is ExitReason.UNLOADED:
                continue
            if not cause.reason.restartable:
                await self._hold_failed(None)
                continue
            self.restart_counts[cause.reason.value] += 1
            self._crash_loop.record(self._clock())
            if self._crash_loop.tripped(self._clock()):
                continue
            # A worker that became ready proved the engine boots: restart it at once. Failed
            # boots back off; the crash-loop guard above bounds crashes after ready.
            delay = 0.0 if cause.phase == "running" else self._backoff.next_delay()
            self._retry_at = self._clock() + delay
            self._set_state(EngineState.BACKOFF, f"restart in {delay:.1f}s after {cause.reason}")
            await self._nap(delay)
        self._set_state(EngineState.STOPPED, "supervisor stopping")

    # --- one worker's life ------------------------------------------------------------------

    async def _run_worker(self) -> ExitCause:
        self._retry_at = None
        self._serial += 1
        self._set_state(EngineState.STARTING, "spawning worker")
        self._mark("spawned")
        try:
            worker = await self._launcher.start()
        except OSError as exc:
            return self._record(ExitCause("boot", ExitReason.SPAWN_FAILED, str(exc)))
        self._worker = worker
        watcher = asyncio.ensure_future(worker.wait())
        watcher.add_done_callback(lambda _: self._on_exit(worker))
        for monitor in self._monitors:
            monitor.reset()
        try:
            cause = await self._boot(worker)
            if cause is None:
                self._ready_since = self._clock()
                self._set_state(EngineState.READY, f"worker {worker.pid} serving")
                self._backoff.reset()  # it booted: the next failed boot starts a fresh series
                self._recovered()
                cause = await self._watch(worker)
        finally:
            self._fire_lost()
            self._ready_since = None
        detected = self._clock()
        self._recovery = {"detected": detected}
        if self._forensics is not None:  # a hang's stacks, before the processes are killed
            await self._forensics.before_stop(worker, cause)
        cause = await self._stop_worker(worker, cause)
        watcher.cancel()
        cause = self._record(cause)
        if self._forensics is not None:
            self._forensics.stopped(worker, cause, self._clock() - detected)
        return cause

    def _on_exit(self, worker: Worker) -> None:
        """Runs the moment the worker exits: the API must answer 503 at once, not at next probe."""
        if worker is self._worker and self._state in (EngineState.READY, EngineState.STARTING,
                                                      EngineState.DRAINING, EngineState.SLEEPING):
            self._fire_lost()
            phase: Phase = "boot" if self._state is EngineState.STARTING else "running"
            # /health shows the cause at once; the full record follows once the tree is reaped.
            cause = self._remember(self._serial, process_exit(worker.returncode, phase))
            self._set_state(EngineState.STOPPING, cause.detail)
        self._wake.set()

    async def _boot(self, worker: Worker) -> ExitCause | None:
        """None once the worker serves and decodes; else why it never became ready."""
        deadline = self._clock() + self._sup.startup_timeout_s
        while True:
            if worker.returncode is not None:
                return process_exit(worker.returncode, "boot")
            if self._stop_requested:
                return ExitCause("boot", ExitReason.STOPPED, "stop requested while starting")
            if not self.loaded:
                return ExitCause("boot", ExitReason.UNLOADED, "unloaded while starting")
            if self._clock() >= deadline:
                return ExitCause("boot", ExitReason.STARTUP_TIMEOUT,
                                 f"not ready after {self._sup.startup_timeout_s:.0f}s")
            if await self._prober.serving() and await self._prober.canary(self._sup.canary_timeout_s):
                return None
            for monitor in self._monitors:
                cause = await monitor.check(worker) if getattr(monitor, "watches_boot", False) else None
                if cause is not None:
                    return replace(cause, phase="boot")
            await self._nap(self._sup.boot_poll_s)

    async def _watch(self, worker: Worker) -> ExitCause:
        """Ask every monitor on each turn until one declares the worker dead; returns why."""
        tick = min(self._sup.health_interval_s, self._sup.progress_interval_s)
        while True:
            if worker.returncode is not None:
                return process_exit(worker.returncode, "running")
            if self._stop_requested:
                return ExitCause("running", ExitReason.STOPPED, "stop requested")
            if not self.loaded:
                cause = await self._doze(worker)
                if cause is not None:
                    return cause
                continue
            for monitor in self._monitors:
                cause = await monitor.check(worker)
                if cause is not None:
                    return cause
            await self._nap(tick)

    async def _stop_worker(self, worker: Worker, cause: ExitCause) -> ExitCause:
        self._remember(self._serial, cause)  # /health tells why while the stop runs
        self._set_state(EngineState.STOPPING, cause.reason.value)
        pids = worker.tree_pids() | {worker.pid}
        report = await worker.stop(self._sup.stop_grace_s)
        if report.stragglers:
            log.warning("worker.stragglers_killed", pids=report.stragglers)
        if self._gpu is not None and not await self._gpu.wait_released(
                pids, self._sup.gpu_release_timeout_s):
            return replace(cause, reason=ExitReason.GPU_FATAL, detail=(
                f"old worker pids {sorted(pids)} still hold GPU memory after "
                f"{self._sup.gpu_release_timeout_s:.0f}s; not starting a worker that would fail"))
        unfit = await self._gpu.settle() if self._gpu is not None else None  # its last Xids
        if unfit is not None:
            return replace(cause, reason=ExitReason.GPU_FATAL, detail=unfit)
        self._mark("stopped")
        return cause

    def _record(self, cause: ExitCause) -> ExitCause:
        self._remember(self._serial, cause)
        event = "engine.boot_failed" if cause.phase == "boot" else "engine.exited"
        if cause.reason.asked:
            log.info(event, reason=cause.reason.value, detail=cause.detail)
        else:
            log.error(event, reason=cause.reason.value, detail=cause.detail, restarts=self.restarts)
        return cause

    # --- restart timings: detected → stopped → spawned → ready ------------------------------

    def _mark(self, step: str) -> None:
        if self._recovery is not None:
            self._recovery[step] = self._clock()

    def _recovered(self) -> None:
        """The worker is ready: put the recovery's durations on the exit that started it."""
        marks, self._recovery = self._recovery, None
        if marks is None or self._last_exit is None or "stopped" not in marks:
            return
        ready = self._clock()
        spawned = marks.get("spawned", marks["stopped"])
        timings = {"stop_s": marks["stopped"] - marks["detected"],
                   "backoff_s": spawned - marks["stopped"],
                   "boot_s": ready - spawned,
                   "total_s": ready - marks["detected"]}
        # The exit that started this recovery belongs to the worker before this one.
        recovered = self._remember(self._serial - 1, replace(
            self._last_exit, restart={k: round(v, 3) for k, v in timings.items()}))
        log.info("engine.recovered", **recovered.restart)
        if self._forensics is not None:
            self._forensics.recovered(recovered)
        for listener in self.phase_listeners:
            for phase, seconds in timings.items():
                listener(phase.removesuffix("_s"), seconds)

    def _remember(self, serial: int, cause: ExitCause) -> ExitCause:
        """`cause` is the last exit, and worker `serial`'s entry in the recent exits."""
        self._last_exit = cause
        if self._exits and self._exits[-1][0] == serial:
            self._exits[-1] = (serial, cause)
        else:
            self._exits.append((serial, cause))
        return cause

    # --- waiting and states -----------------------------------------------------------------

    async def _hold_failed(self, until: float | None) -> None:
        """`failed`: no restart until the crash-loop window clears (or never, for a dead GPU)."""
        self._retry_at = until
        self._recovery = None
        detail = self._last_exit.detail if self._last_exit else "crash loop"
        self._set_state(EngineState.FAILED, detail)
        while not self._stop_requested and self.loaded and (
                until is None or self._clock() < until):
            await self._nap(60.0 if until is None else max(0.0, until - self._clock()))
        self._backoff.reset()

    async def _nap(self, delay: float) -> None:
        """Sleep `delay`, or less if the worker exits or a stop is requested."""
        self.last_tick = self._clock()
        self._wake.clear()
        sleeper = asyncio.ensure_future(self._sleep(delay))
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waker):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _fire_lost(self) -> None:
        self._lost = self._serial  # it answers no more, whatever its /health says meanwhile
        if self._forensics is not None:  # the requests in flight, before their relays end them
            self._forensics.lost()
        callbacks, self._lost_callbacks = list(self._lost_callbacks.values()), {}
        for callback in callbacks:
            callback()

    def _set_state(self, new: EngineState, cause: str) -> None:
        if new is EngineState.READY and self._draining:
            new = EngineState.DRAINING
        old = self._state
        if old is new:
            return
        self._state = new
        self._pulse()
        self.transition_counts[new.value] += 1
        log.info("engine.state", old=old.value, new=new.value, cause=cause)
        for listener in self.listeners:
            listener(old, new, cause)
