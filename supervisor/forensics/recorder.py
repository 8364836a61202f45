"""What an engine death leaves behind: gathered at the moments the manager passes through.

- lost: the worker stopped serving; the requests still waiting on it are described now, before
  their relays end them (fingerprints, routes, clients, sizes; bodies only by setting);
- before_stop: for a hang, the stacks of the worker's processes while they still exist;
- stopped: the bundle is written (cause, stop time, the worker's last output lines, the
  engine's last metrics, GPU readings and Xids), and the fingerprints in flight are told to
  whoever counts deaths per request (the API's quarantine, appliance.recovery);
- recovered: the restart timings are added once the next worker is ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import structlog

from appliance.core.engine import Waiting
from appliance.core.settings import Settings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.stats import EngineStats
from supervisor.engine.worker import Worker
from supervisor.forensics.bundles import Bundles
from supervisor.forensics.stacks import dump_stacks, find_py_spy

log = structlog.get_logger("supervisor.forensics.recorder")

_HANGS = (ExitReason.HUNG, ExitReason.UNHEALTHY)  # the processes are alive: their stacks tell


class Recorder:
    """Implements the manager's Forensics hooks; one bundle per death."""

    def __init__(self, settings: Settings, waiting: Waiting, *,
                 metrics: Callable[[], EngineStats | None],
                 gpu: Callable[[], dict[str, Any]],
                 bundles: Bundles | None = None, py_spy: str | None = None,
                 deaths: Callable[[list[str]], None] | None = None) -> None:
        self._crash = settings.crashes
        self._waiting = waiting
        self._metrics = metrics
        self._gpu = gpu
        self.bundles = bundles or Bundles(settings.crashes)
        self._py_spy = py_spy or find_py_spy(settings.engine.python)
        self._deaths = deaths  # told each death's in-flight fingerprints
        self._in_flight: list[dict[str, Any]] | None = None
        self._stacks: dict[str, str] | None = None
        self._written: tuple[str, dict[str, Any]] | None = None
        self.last: str | None = None  # the newest bundle's name, for /health and the page

    def lost(self) -> None:
        if self._in_flight is None:
            self._in_flight = self._waiting.describe(self._crash.bodies)

    async def before_stop(self, worker: Worker, cause: ExitCause) -> None:
        if cause.reason in _HANGS and worker.returncode is None:
            pids = sorted(worker.tree_pids() | {worker.pid})
            self._stacks = await dump_stacks(pids, self._py_spy, self._crash.stack_timeout_s)

    def stopped(self, worker: Worker, cause: ExitCause, stopped_in_s: float) -> None:
        in_flight, stacks = self._in_flight or [], self._stacks
        self._in_flight, self._stacks, self._written = None, None, None
        if cause.reason.asked:
            return
        if self._deaths is not None:
            self._deaths([entry["fingerprint"] for entry in in_flight])
        stats = self._metrics()
        tail = list(worker.tail)[-self._crash.log_lines:] if self._crash.log_lines else []
        bundle: dict[str, Any] = {
            "pid": worker.pid,
            "cause": cause.as_dict(),
            "stopped_in_s": round(stopped_in_s, 3),
            "written_at": time.time(),
            "in_flight": in_flight,
            "engine_metrics": asdict(stats) if stats is not None else None,
            "gpu": self._gpu(),
            "stacks": stacks,
            "log_tail": tail,
        }
        name = self.bundles.write(bundle)
        if name is not None:
            self._written, self.last = (name, bundle), name
            log.info("crash.bundle", name=name, dir=str(self.bundles.dir),
                     in_flight=len(in_flight), stacks=stacks is not None)

    def recovered(self, cause: ExitCause) -> None:
        """The restart that followed the last bundle's death completed: add its timings."""
        if self._written is None:
            return
        name, bundle = self._written
        self._written = None
        self.bundles.write(bundle | {"cause": cause.as_dict()}, name)
