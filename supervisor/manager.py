"""The engine manager: spawn, probe, declare dead, stop, back off, restart; the state machine."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import structlog

from appliance.engine import EngineState
from appliance.settings import Settings
from supervisor.backoff import Backoff, CrashLoop
from supervisor.worker import StopReport, describe_exit

log = structlog.get_logger("supervisor.manager")

Phase = Literal["boot", "running"]


class Worker(Protocol):
    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def tree_pids(self) -> set[int]: ...

    async def stop(self, grace_s: float) -> StopReport: ...


class Launcher(Protocol):
    async def start(self) -> Worker: ...


class Prober(Protocol):
    async def healthy(self) -> bool: ...

    async def serving(self) -> bool: ...

    async def canary(self, timeout_s: float) -> bool: ...


class GpuWatch(Protocol):
    def summary(self) -> dict[str, Any]: ...

    async def check(self) -> tuple[Literal["none", "restart_worker", "fail"], str]: ...

    async def wait_released(self, pids: set[int], timeout_s: float) -> bool: ...


@dataclass
class ExitCause:
    """Why a worker stopped serving; `phase` tells a boot failure from a crash after ready."""

    phase: Phase
    reason: str  # exited, unhealthy, hung, gpu, startup_timeout, spawn_failed, stopped
    detail: str
    at: float = 0.0  # wall clock, for /health

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Transition = Callable[[EngineState, EngineState, str], None]


class EngineManager:
    """Owns the worker's life; the API reads it through appliance.engine.EngineView."""

    def __init__(
        self,
        settings: Settings,
        launcher: Launcher,
        prober: Prober,
        *,
        gpu: GpuWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._settings = settings
        self._sup = settings.supervisor
        self._launcher = launcher
        self._prober = prober
        self._gpu = gpu
        self._clock = clock
        self._sleep = sleep
        sup = settings.supervisor
        self._backoff = Backoff(sup.backoff_initial_s, sup.backoff_max_s, sup.backoff_jitter, rand)
        self._crash_loop = CrashLoop(sup.crash_loop_restarts, sup.crash_loop_window_s)
        self._state = EngineState.STOPPED
        self._worker: Worker | None = None
        self._lost = asyncio.Event()
        self._wake = asyncio.Event()
        self._stop_requested = False
        self._started_at = clock()
        self._ready_since: float | None = None
        self._restarts = 0
        self._last_exit: ExitCause | None = None
        self._in_flight = 0
        self._last_progress = clock()
        self._retry_at: float | None = None
        self.last_tick = clock()  # the loop's heartbeat, for the systemd watchdog
        self.listeners: list[Transition] = []
        self.restart_listeners: list[Callable[[str], None]] = []

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

    def lost(self) -> asyncio.Event:
        return self._lost

    def note_request(self, delta: int) -> None:
        if self._in_flight == 0 and delta > 0:
            self._last_progress = self._clock()  # the stall clock starts with the first request
        self._in_flight = max(0, self._in_flight + delta)

    def note_progress(self) -> None:
        self._last_progress = self._clock()

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "state": self._state.value,
            "pid": self.pid,
            "model": self.model_name,
            "uptime_s": round(now - self._ready_since, 1) if self._ready_since else None,
            "supervisor_uptime_s": round(now - self._started_at, 1),
            "restarts": self._restarts,
            "in_flight": self._in_flight,
            "last_exit": self._last_exit.as_dict() if self._last_exit else None,
            "gpu": self._gpu.summary() if self._gpu else {"status": "unavailable"},
        }

    # --- control ----------------------------------------------------------------------------

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def startup_timeout_s(self) -> float:
        return self._sup.startup_timeout_s

    def loop_is_turning(self) -> bool:
        """False once the manager has gone longer without a pass than any one step may take."""
        sup = self._sup
        longest_step = (2 * sup.health_timeout_s + sup.canary_timeout_s + sup.stop_grace_s
                        + sup.gpu_release_timeout_s + 30)
        return self._clock() - self.last_tick < max(longest_step, sup.health_interval_s * 3)

    @property
    def last_exit(self) -> ExitCause | None:
        return self._last_exit

    def begin_drain(self) -> None:
        """Stop admitting: health and new requests answer 503 while in-flight ones finish."""
        if self._state in (EngineState.READY, EngineState.UNHEALTHY):
            self._set_state(EngineState.DRAINING, "shutdown requested")

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        self._stop_requested = True
        self._wake.set()

    async def run(self) -> None:
        """Keep a worker serving until request_stop(); returns once the worker is stopped."""
        while not self._stop_requested:
            now = self._clock()
            if self._crash_loop.tripped(now):
                await self._hold_failed(self._crash_loop.clears_at())
                continue
            cause = await self._run_worker()
            if cause.reason == "gpu_fatal":
                await self._hold_failed(None)
                continue
            if self.stop_requested:
                break
            self._restarts += 1
            for listener in self.restart_listeners:
                listener(cause.reason)
            self._crash_loop.record(self._clock())
            if self._crash_loop.tripped(self._clock()):
                continue
            delay = self._backoff.next_delay()
            self._retry_at = self._clock() + delay
            self._set_state(EngineState.BACKOFF, f"restart in {delay:.1f}s after {cause.reason}")
            await self._nap(delay)
        self._set_state(EngineState.STOPPED, "supervisor stopping")

    # --- one worker's life ------------------------------------------------------------------

    async def _run_worker(self) -> ExitCause:
        self._retry_at = None
        self._set_state(EngineState.STARTING, "spawning worker")
        try:
            worker = await self._launcher.start()
        except OSError as exc:
            return self._record(ExitCause("boot", "spawn_failed", str(exc)))
        self._worker = worker
        self._lost = asyncio.Event()
        watcher = asyncio.ensure_future(worker.wait())
        watcher.add_done_callback(lambda _: self._on_exit(worker))
        served_s = 0.0
        try:
            cause = await self._boot(worker)
            if cause is None:
                self._ready_since = self._clock()
                self._set_state(EngineState.READY, f"worker {worker.pid} serving")
                cause = await self._watch(worker)
                served_s = self._clock() - self._ready_since
        finally:
            self._lost.set()
            self._ready_since = None
        await self._stop_worker(worker, cause)
        watcher.cancel()
        if served_s >= self._sup.backoff_max_s:
            self._backoff.reset()  # it served a good while: this is a fresh failure, not a loop
        return self._record(cause)

    def _on_exit(self, worker: Worker) -> None:
        """Runs the moment the worker exits: the API must answer 503 at once, not at next probe."""
        if worker is self._worker and self._state in (EngineState.READY, EngineState.STARTING,
                                                      EngineState.UNHEALTHY, EngineState.DRAINING):
            self._lost.set()
            how = describe_exit(worker.returncode)
            # /health shows the cause at once; the full record follows once the tree is reaped.
            self._last_exit = (ExitCause("boot", "exited", f"never became ready: {how}", time.time())
                               if self._state is EngineState.STARTING else
                               ExitCause("running", "exited", f"crashed after ready: {how}",
                                         time.time()))
            self._set_state(EngineState.STOPPING, f"worker exited: {how}")
        self._wake.set()

    async def _boot(self, worker: Worker) -> ExitCause | None:
        """None once the worker serves and decodes; else why it never became ready."""
        deadline = self._clock() + self._sup.startup_timeout_s
        while True:
            if worker.returncode is not None:
                return ExitCause("boot", "exited", f"never became ready: {describe_exit(worker.returncode)}")
            if self._stop_requested:
                return ExitCause("boot", "stopped", "stop requested while starting")
            if self._clock() >= deadline:
                return ExitCause("boot", "startup_timeout",
                                 f"not ready after {self._sup.startup_timeout_s:.0f}s")
            if await self._prober.serving() and await self._prober.canary(self._sup.canary_timeout_s):
                return None
            await self._nap(min(1.0, self._sup.health_interval_s))

    async def _watch(self, worker: Worker) -> ExitCause:
        """Probe until something declares the worker dead; returns why."""
        failures = 0
        last_canary = self._clock()
        while True:
            if worker.returncode is not None:
                detail = f"crashed after ready: {describe_exit(worker.returncode)}"
                return ExitCause("running", "exited", detail)
            if self._stop_requested:
                return ExitCause("running", "stopped", "stop requested")
            verdict = await self._gpu_verdict()
            if verdict is not None:
                return verdict
            if await self._prober.healthy():
                failures = 0
            else:
                failures += 1
                log.warning("engine.probe_failed", consecutive=failures, limit=self._sup.health_failures)
                if failures >= self._sup.health_failures:
                    return ExitCause("running", "unhealthy", f"{failures} consecutive /health failures")
            hung = await self._stall_check(last_canary)
            if hung is not None:
                return hung
            if self._clock() - last_canary >= self._sup.canary_interval_s:
                last_canary = self._clock()
            await self._nap(self._sup.health_interval_s)

    async def _stall_check(self, last_canary: float) -> ExitCause | None:
        """A stall (in-flight work, no bytes) or an idle canary interval both ask for a decode."""
        now = self._clock()
        stalled = self._in_flight > 0 and now - self._last_progress >= self._sup.stall_timeout_s
        idle_due = self._in_flight == 0 and now - last_canary >= self._sup.canary_interval_s
        if not (stalled or idle_due):
            return None
        if await self._prober.canary(self._sup.canary_timeout_s):
            self._last_progress = self._clock()
            return None
        what = "no bytes from the worker" if stalled else "idle canary"
        return ExitCause("running", "hung", f"{what} and the 1-token canary failed")

    async def _gpu_verdict(self) -> ExitCause | None:
        if self._gpu is None:
            return None
        action, cause = await self._gpu.check()
        if action == "restart_worker":
            return ExitCause("running", "gpu_app_error", cause)
        if action == "fail":
            return ExitCause("running", "gpu_fatal", cause)
        return None

    async def _stop_worker(self, worker: Worker, cause: ExitCause) -> None:
        self._set_state(EngineState.STOPPING, cause.reason)
        pids = worker.tree_pids() | {worker.pid}
        report = await worker.stop(self._sup.stop_grace_s)
        if report.stragglers:
            log.warning("worker.stragglers_killed", pids=report.stragglers)
        if self._gpu is not None and not await self._gpu.wait_released(
            pids, self._sup.gpu_release_timeout_s
        ):
            cause.reason, cause.detail = "gpu_fatal", (
                f"old worker pids {sorted(pids)} still hold GPU memory after "
                f"{self._sup.gpu_release_timeout_s:.0f}s; not starting a worker that would fail"
            )

    def _record(self, cause: ExitCause) -> ExitCause:
        cause.at = time.time()
        self._last_exit = cause
        event = "engine.boot_failed" if cause.phase == "boot" else "engine.exited"
        if cause.reason == "stopped":
            log.info(event, reason=cause.reason, detail=cause.detail)
        else:
            log.error(event, reason=cause.reason, detail=cause.detail, restarts=self._restarts)
        return cause

    async def _hold_failed(self, until: float | None) -> None:
        """`failed`: no restart until the crash-loop window clears (or never, for a dead GPU)."""
        self._retry_at = until
        detail = self._last_exit.detail if self._last_exit else "crash loop"
        self._set_state(EngineState.FAILED, detail)
        while not self._stop_requested and (until is None or self._clock() < until):
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

    def _set_state(self, new: EngineState, cause: str) -> None:
        old = self._state
        if old is new:
            return
        self._state = new
        log.info("engine.state", old=old.value, new=new.value, cause=cause)
        for listener in self.listeners:
            listener(old, new, cause)
