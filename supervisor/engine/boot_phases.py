"""The engine's boot in phases a person can follow, read from the worker's own log lines.

A cold start is a minute or more of silence from the API's point of view (503s). vLLM says
what it is doing in its log, in words that differ by device and version; the vLLM contract
(appliance/fences/vllm.py) knows the lines that open each phase, and this module logs
`engine.boot` once per phase with the seconds since the spawn, then `engine.booted` with the
whole timeline. A line it does not know changes nothing, so a
new vLLM that rewords a line costs a phase in the display, never the boot.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from appliance.fences.vllm import BOOT_LINES

log = structlog.get_logger("supervisor.boot")

IMPORTING = "importing vLLM"
READY = "ready"  # the name of BOOT_LINES' last phase

# In boot order: the phase a line opens, and the lines that open it (the vLLM contract's).
# Phases only move forward, so the same words repeated later (EngineCore reprints config
# warnings) change nothing.
_PHASES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(lines)) for name, lines in BOOT_LINES)


@dataclass(frozen=True)
class BootPhase:
    """A phase the boot entered, `after_s` seconds after the worker was spawned."""

    name: str
    after_s: float


class BootPhases:
    """One worker's boot: feed it every output line; it logs each phase as it is reached."""

    def __init__(self, started_at: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._started_at = started_at
        self._clock = clock
        self._reached = [BootPhase(IMPORTING, 0.0)]
        self._next = 0  # index into _PHASES of the earliest phase not reached yet

    @property
    def phase(self) -> BootPhase:
        return self._reached[-1]

    @property
    def done(self) -> bool:
        return self.phase.name == READY

    def feed(self, line: str) -> BootPhase | None:
        """The phase this line opens (logged), or None: an ordinary line, or boot is over."""
        if self.done:
            return None
        for index in range(self._next, len(_PHASES)):
            name, opens = _PHASES[index]
            if opens.search(line):
                return self._enter(index, name)
        return None

    def timeline(self) -> str:
        """'importing vLLM 26.3 s → configuring 55.8 s → … → ready after 104.4 s'."""
        steps = [f"{here.name} {there.after_s - here.after_s:.1f} s"
                 for here, there in zip(self._reached, self._reached[1:], strict=False)]
        last = self.phase
        tail = f"ready after {last.after_s:.1f} s" if self.done else f"{last.name} …"
        return " → ".join([*steps, tail])

    def _enter(self, index: int, name: str) -> BootPhase:
        phase = BootPhase(name, round(self._clock() - self._started_at, 1))
        self._reached.append(phase)
        self._next = index + 1
        log.info("engine.boot", phase=name, after_s=phase.after_s)
        if self.done:
            log.info("engine.booted", after_s=phase.after_s, timeline=self.timeline())
        return phase
