"""Whether the worker's API server ran while a question to it went unanswered.

A server that is slow (starved of CPU, busy tokenizing) still runs: it uses CPU or has a thread
waiting for a core. One that neither answers nor runs for `hang_stall_s` is stopped (SIGSTOP,
a deadlock), and waiting the K failed probes of the health monitor (each a full timeout, about
11 s apart while the progress watch's /metrics read times out too) only delays the restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance.core.sections import SupervisorSettings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.worker import Worker
from supervisor.monitors.activity import Activity, cpu_seconds, thread_states


def server_activity(worker: Worker, threads: bool) -> Activity | None:
    """The API server process alone (the pid /health names); None once it is gone."""
    cpu_s = cpu_seconds(worker.pid)
    if cpu_s is None:
        return None
    runnable, stopped = thread_states(worker.pid) if threads else (0, False)
    return Activity(cpu_s, runnable, stopped)


@dataclass
class _Unanswered:
    since: float
    base: Activity


class Stillness:
    """Call `asking` before each question to the server and `answered` or `unanswered` after."""

    def __init__(self, settings: SupervisorSettings, what: str, *,
                 activity: Callable[[Worker, bool], Activity | None] = server_activity,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sup = settings
        self._what = what  # the question, for the verdict's detail
        self._activity = activity
        self._clock = clock
        self._asked_at = clock()
        self._mark: tuple[float, Activity] | None = None
        self._silent: _Unanswered | None = None

    def reset(self) -> None:
        self._mark, self._silent = None, None

    def asking(self, worker: Worker) -> None:
        """Marks the CPU time before a question; not again while the server stays silent."""
        self._asked_at = self._clock()
        if self._silent is None:
            activity = self._activity(worker, False)
            self._mark = (self._clock(), activity) if activity is not None else None

    def answered(self) -> None:
        self._silent = None

    def unanswered(self, worker: Worker, waiting: int = 0) -> ExitCause | None:
        """A hang once the server has neither answered nor run for `hang_stall_s`."""
        if self._clock() - self._asked_at < self._sup.health_timeout_s:
            self._silent = None  # a quick failure came back (refused, an error status): an answer
            return None
        if self._silent is None:
            if self._mark is None:
                return None
            self._silent = _Unanswered(*self._mark)
        now = self._clock()
        after = self._activity(worker, True)
        if after is None:
            return None  # gone: its exit is the manager's to see
        silent_s = now - self._silent.since
        used = after.cpu_s - self._silent.base.cpu_s
        sup = self._sup
        owed = f" with requests waiting on it ({waiting})" if waiting else ""
        if after.stopped:
            # Whatever it used before it was stopped (a busy server's last moments can exceed
            # the floor and put the verdict off by a whole question): it will not run again.
            return ExitCause("running", ExitReason.HUNG,
                             f"the worker's API server did not answer {self._what} for "
                             f"{now - self._asked_at:.1f}s{owed} and is stopped (a signal or "
                             "a tracer): not running")
        if silent_s < sup.hang_stall_s or after.runnable or used >= sup.hang_cpu_floor * silent_s:
            return None
        return ExitCause("running", ExitReason.HUNG,
                         f"the worker's API server did not answer {self._what} for "
                         f"{silent_s:.1f}s{owed} and used {used:.2f}s of CPU meanwhile: "
                         "not running")
