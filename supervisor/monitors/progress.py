"""Hang detection from the engine's own progress, never from silence on client streams.

A busy engine is not a hung engine. Measured on vLLM 0.32 (CPU): while one long prompt is
prefilled (8k tokens, 30-125 s here) the worker's counters of prompt tokens, generation tokens
and iterations do not move at all, since stats are recorded only when a step yields output;
what does move is the engine processes' CPU time. So the verdicts are:

- fast: busy, no counter has moved for `hang_stall_s`, the engine processes (the worker's tree
  without its API server) used less than `hang_cpu_floor` of a core meanwhile, and not one of
  their threads was seen runnable in any sample: the engine is not running at all (stopped,
  deadlocked): hung, within seconds. A starved engine on a loaded machine (measured here:
  0.5 tokens/s, 0.03 s of CPU in 5 s, with five engines on two cores) has runnable threads
  waiting for a core, so it is never mistaken for a stopped one;
- slow: busy and still no counter movement after 3x the longest step this appliance has seen
  complete (at least `hang_busy_floor_s`): running but getting nowhere (a loop, a wedged GPU);
- idle: nothing to do for `canary_interval_s`: a 1-token canary must answer in time, or the
  engine must at least be seen running meanwhile (starved, not stopped).

"Busy" is the engine's own gauges, or the appliance's requests waiting on the worker when one
was sent since the counters last moved: vLLM's gauges come from EngineCore's stats, so an
EngineCore that stopped while idle keeps saying "idle" to a request it never picked up (seen:
47 s to a verdict through the idle canary). A request the engine had already worked on when its
counters last moved is not one (a stream its slow client has not read yet owes the engine
nothing). While only the appliance knows of the work, the API server's CPU time counts too:
it may still be preparing the request (tokenizing, decoding images) before EngineCore sees it.
And with requests waiting, a /metrics read that gets no answer is not "unknown": a
server that neither answers nor runs for `hang_stall_s` is stopped (supervisor.monitors.stillness).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

import structlog

from appliance.core.sections import SupervisorSettings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.stats import EngineStats
from supervisor.engine.worker import Worker
from supervisor.monitors.activity import Activity, EngineActivity
from supervisor.monitors.stillness import Stillness

log = structlog.get_logger("supervisor.monitors.progress")


class ProgressProber(Protocol):
    async def engine_stats(self) -> EngineStats | None: ...

    async def canary(self, timeout_s: float) -> bool: ...


class WorkerDemand(NamedTuple):
    """The appliance's own requests on the worker (appliance.core.engine.Waiting)."""

    in_flight: int  # waiting on the worker
    sent: int  # sent to it so far
    unanswered: int = 0  # in flight with no byte of their answer yet


Demand = Callable[[], WorkerDemand]


class ProgressMonitor:
    """Reads the engine's counters each `progress_interval_s` while there is work, and only
    then. With a `demand` (the API's requests on the worker), a reading that found the engine
    idle stays true until a request is sent: nothing else makes it work, so the monitor does not ask
    again (a read of its series costs the worker's API server ~1.2 ms of CPU, the whole page
    ~5 ms) and runs only the idle canary. The engine threads' states (a /proc file per thread) are read
    only while the counters stand still, the one time a verdict needs them."""

    name = "progress"

    def __init__(self, prober: ProgressProber, settings: SupervisorSettings, *,
                 demand: Demand | None = None,
                 activity: Callable[[Worker, bool], Activity | None] | None = None,
                 stillness: Stillness | None = None,
                 server: Callable[[Worker, bool], Activity | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._prober = prober
        self._sup = settings
        self._demand = demand
        self._stillness = stillness
        self._server = server  # the API server's own activity (supervisor.monitors.stillness)
        self._clock = clock
        self._activity = activity or EngineActivity(clock)
        self.stats: EngineStats | None = None  # the last reading, for /metrics
        self.longest_step_s = 0.0  # the longest busy stretch without counter movement that ended well
        self.reset()

    def reset(self) -> None:
        now = self._clock()
        self.stats = None
        self._due = now
        self._counters: tuple[float, ...] | None = None
        self._last_progress = now
        self._last_canary = now
        self._samples: deque[tuple[float, Activity]] = deque()
        self._admitted_at_reading: int | None = None  # the demand's count when last read idle
        self._sent_at_progress: int | None = None  # the demand's count when the counters moved
        self._server_marks: deque[tuple[float, float]] = deque()  # (when, server CPU seconds)
        if self._stillness is not None:
            self._stillness.reset()

    async def check(self, worker: Worker) -> ExitCause | None:
        now = self._clock()
        if now < self._due:
            return None
        self._due = now + self._sup.progress_interval_s
        demand = self._demand() if self._demand is not None else None
        if self._still_idle(demand):
            return await self._idle(now, worker)
        if self._stillness is not None:
            self._stillness.asking(worker)
        stats = await self._prober.engine_stats()
        if stats is None:
            return self._unanswered(now, worker, demand)
        if self._stillness is not None:
            self._stillness.answered()
        self.stats = stats
        busy = stats.busy or self._owed(demand)
        if stats.busy or not busy:
            self._server_marks.clear()
        self._admitted_at_reading = demand.sent if demand is not None and not busy else None
        if not busy:
            self._counters = stats.progress
            self._sent_at_progress = demand.sent if demand is not None else None
            return await self._idle(now, worker)
        if stats.progress != self._counters:
            stretch = now - self._last_progress
            if self._counters is not None:
                self.longest_step_s = max(self.longest_step_s, stretch)
            self._counters, self._last_progress = stats.progress, now
            self._sent_at_progress = demand.sent if demand is not None else None
            # The base of a later stall's window: a sample at or before its start, whose
            # threads a verdict never reads (only those of samples after the start).
            self._sample(now, self._activity(worker, False))
            return None
        self._sample(now, self._activity(worker, True))
        if not stats.busy and self._server_working(now, worker):
            return None
        return self._verdict(now)

    async def _idle(self, now: float, worker: Worker) -> ExitCause | None:
        self._last_progress = now  # idle is not stalled
        self._sample(now, self._activity(worker, False))
        return await self._idle_canary(now, worker)

    def _owed(self, demand: WorkerDemand | None) -> bool:
        """Requests wait on the worker, and one was sent since the engine last made progress or
        one has had no byte of its answer yet. The second matters when the counters moved for
        another request just after this one was sent and the engine stopped before taking it:
        its gauges say idle, yet it owes that request its first token."""
        return demand is not None and demand.in_flight > 0 and (
            demand.sent != self._sent_at_progress or demand.unanswered > 0)

    def _server_working(self, now: float, worker: Worker) -> bool:
        """Only the appliance knows of the work: the API server may still be preparing it
        (tokenizing, decoding images) before EngineCore sees any of it. True while its CPU
        time over the last `hang_stall_s` says so, or that window is not covered yet."""
        if self._server is None:
            return False
        reading = self._server(worker, False)
        if reading is None:
            return True  # gone: its exit is the manager's to see
        marks, sup = self._server_marks, self._sup
        marks.append((now, reading.cpu_s))
        while len(marks) > 1 and marks[1][0] <= now - sup.hang_stall_s:
            marks.popleft()
        since, base = marks[0]
        if now - since < sup.hang_stall_s:
            return True
        return reading.cpu_s - base >= sup.hang_cpu_floor * (now - since)

    def _unanswered(self, now: float, worker: Worker,
                    demand: WorkerDemand | None) -> ExitCause | None:
        """/metrics got no answer: with requests waiting, a server that does not run is hung;
        else the health monitor's call to make."""
        self._sample(now, self._activity(worker, True))
        waiting = demand.in_flight if demand is not None else 0
        if self._stillness is None or not waiting:
            return None
        return self._stillness.unanswered(worker, waiting)

    def _still_idle(self, demand: WorkerDemand | None) -> bool:
        """The last reading found the engine idle and no request was admitted since."""
        if demand is None or self._admitted_at_reading is None:
            return False
        return demand.in_flight == 0 and demand.sent == self._admitted_at_reading

    def _verdict(self, now: float) -> ExitCause | None:
        sup = self._sup
        stalled = now - self._last_progress
        used = self._idle_cpu_since(now - sup.hang_stall_s)
        if stalled >= sup.hang_stall_s and used is not None \
                and used < sup.hang_cpu_floor * sup.hang_stall_s:
            return ExitCause("running", ExitReason.HUNG,
                             f"busy with no progress for {stalled:.1f}s and the engine used "
                             f"{used:.2f}s of CPU in the last {sup.hang_stall_s:g}s: not running")
        bound = max(sup.hang_busy_floor_s, 3 * self.longest_step_s)
        if stalled >= bound:
            return ExitCause("running", ExitReason.HUNG,
                             f"busy and running with no progress for {stalled:.0f}s, over 3x "
                             f"the longest step seen ({self.longest_step_s:.0f}s)")
        return None

    async def _idle_canary(self, now: float, worker: Worker) -> ExitCause | None:
        if now - self._last_canary < self._sup.canary_interval_s:
            return None
        self._last_canary = now
        self._admitted_at_reading = None  # the canary moves the counters: read them again
        before = self._activity(worker, True)
        if await self._prober.canary(self._sup.canary_timeout_s):
            return None
        # No answer in time: a stopped engine, or a starved one still working on it (seen
        # here at load 26 on two cores). Only the first is a hang.
        after = self._activity(worker, True)
        timeout = self._sup.canary_timeout_s
        if before is not None and after is not None and (
                after.runnable or after.cpu_s - before.cpu_s >= self._sup.hang_cpu_floor * timeout):
            log.warning("engine.slow_canary", timeout_s=timeout,
                        cpu_s=round(after.cpu_s - before.cpu_s, 2), runnable=after.runnable)
            return None
        return ExitCause("running", ExitReason.HUNG,
                         f"idle, and a 1-token canary did not answer in {timeout:g}s "
                         "while the engine used no CPU")

    def _sample(self, now: float, activity: Activity | None) -> None:
        if activity is None:
            self._samples.clear()  # the process set changed: earlier samples do not compare
            return
        self._samples.append((now, activity))
        horizon = now - 2 * self._sup.hang_stall_s - self._sup.progress_interval_s
        while len(self._samples) > 2 and self._samples[1][0] <= horizon:
            self._samples.popleft()

    def _idle_cpu_since(self, start: float) -> float | None:
        """CPU seconds used from the last sample at or before `start` to the newest one, if
        no sample in between saw a runnable thread; None when the window is not covered or
        the engine was seen working."""
        base = None
        for at, activity in self._samples:
            if at <= start:
                base = activity.cpu_s
            elif activity.runnable:
                return None
        if base is None:
            return None
        return self._samples[-1][1].cpu_s - base
