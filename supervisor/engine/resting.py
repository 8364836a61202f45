"""The engine manager's side of residency (supervisor.engine.residency): load() and unload(),
and what the manager does while residency wants no serving worker for the model.

Unloaded, the worker is stopped (`unloaded`: no process, its memory given back). Where the
model sleeps (models.<name>.sleep, on a CUDA GPU) the worker is put to sleep instead
(`sleeping`: the process lives, its weights in host memory, its KV cache discarded) and woken
at the next load(). A failed sleep stops the worker, as without sleep mode; a failed wake-up
stops it and starts a new one; its death while asleep is a crash, handled as every crash is.
Nothing watches a sleeping worker but its exit: no health probe, progress or hang watch, no
canary (their checks run only while it serves), and it is watched afresh once awake.

A mixin of supervisor.engine.manager.EngineManager, which owns every attribute named below.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import structlog

from appliance.core.engine import EngineState
from supervisor.engine.exits import ExitCause, ExitReason, process_exit
from supervisor.engine.parts import BootProber
from supervisor.engine.sleep import SleepMode
from supervisor.engine.worker import Worker
from supervisor.monitors import Monitor

log = structlog.get_logger("supervisor.engine.manager")


class Resting:
    loaded: bool  # residency wants a worker for this model (starting, serving or restarting)
    sleep_counts: Counter[str]  # slept, woke, sleep_failed, wake_failed
    _sleeper: SleepMode | None
    _prober: BootProber
    _monitors: list[Monitor]
    _wake: asyncio.Event
    _stop_requested: bool
    _retry_at: float | None
    _recovery: dict[str, float] | None
    _ready_since: float | None
    _clock: Callable[[], float]

    async def _nap(self, delay: float) -> None: ...

    def _set_state(self, new: EngineState, cause: str) -> None: ...

    def load(self) -> None:
        """A serving worker for the model: started (from `unloaded`), or woken (from
        `sleeping`); a no-op if one is wanted already."""
        self.loaded = True
        self._wake.set()

    def unload(self) -> None:
        """No serving worker until load(): stopped, its memory given back, or asleep where the
        model sleeps (residency: when nothing is in flight)."""
        self.loaded = False
        self._wake.set()

    async def _hold_unloaded(self) -> None:
        """`unloaded`: no worker until load() (or a stop)."""
        self._retry_at = None
        self._recovery = None
        self._set_state(EngineState.UNLOADED, "unloaded by residency")
        while not self._stop_requested and not self.loaded:
            await self._nap(60.0)

    async def _doze(self, worker: Worker) -> ExitCause | None:
        """Residency unloaded the serving `worker`: `sleeping` until load(), then awake. None
        once it serves again (its monitors start afresh: the time asleep is neither a hang nor
        a stall). Else why it is stopped: no sleep mode, a failed sleep or wake-up, its death
        while asleep (a crash), or a stop."""
        if self._sleeper is None:
            return ExitCause("running", ExitReason.UNLOADED, "unloaded by residency")
        if (failed := await self._sleeper.sleep()) is not None:
            return self._sleep_failed("sleep", failed)
        self.sleep_counts["slept"] += 1
        self._ready_since = None
        self._set_state(EngineState.SLEEPING, "asleep: its weights in host memory")
        while not self.loaded and not self._stop_requested and worker.returncode is None:
            await self._nap(60.0)  # load(), a stop and the worker's exit each cut it short
        if worker.returncode is not None:
            return process_exit(worker.returncode, "running")
        if self._stop_requested:
            return ExitCause("running", ExitReason.STOPPED, "stop requested while asleep")
        self._set_state(EngineState.STARTING, "waking up")
        failed = await self._sleeper.wake_up()
        if failed is None and not await self._prober.serving():
            failed = "awake, but its /health or /v1/models did not answer"
        if failed is not None:
            return self._sleep_failed("wake_up", failed)
        self.sleep_counts["woke"] += 1
        for monitor in self._monitors:
            monitor.reset()
        self._ready_since = self._clock()
        self._set_state(EngineState.READY, f"worker {worker.pid} awake")
        return None

    def _sleep_failed(self, step: str, detail: str) -> ExitCause:
        self.sleep_counts[f"{step.removesuffix('_up')}_failed"] += 1
        log.warning("engine.sleep_fallback", step=step, detail=detail,
                    then="stop" if step == "sleep" else "stop, and start a new worker")
        return ExitCause("running", ExitReason.UNLOADED, f"{step} failed ({detail}): stopped")
