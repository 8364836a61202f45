"""Requests in flight at repeated engine deaths: counted by fingerprint, not sent again.

One input that crashes (or hangs) the engine would otherwise crash it again each time its
client retries, until the supervisor's crash-loop guard stops restarting the engine for
everyone. The supervisor's crash forensics tell each death with the fingerprints of the
requests in flight at it (`died`); the relay asks before each send to the worker (`check`),
and a fingerprint in flight at `resume.quarantine_after` deaths is answered
`request_quarantined` instead. Fingerprints are remembered for `resume.quarantine_ttl_s` after
their last death, at most `resume.max_quarantined` of them, the least recently seen forgotten.

Only the deaths a fingerprint's presence may explain count against it. The rule:
  a death counts against a fingerprint if a request with it was in flight at that death (a
  worker had it: sent, or being fitted to the budget), and no request with it has been
  answered in full since by a worker that had it through no death (`answered`, told by
  appliance.core.engine.Waiting).
Such an answer proves the input harmless to an engine: one reached it, ran to its end and left
it alive. Whatever deaths it was in flight at had another cause (a kill, a freeze, another
request), so its record is dropped and its count starts again from nothing. A poison input
kills (or hangs) every engine it reaches: it is never answered in full, and its deaths add up
to the bound. An answer whose worker died while it had the request does not clear it (the
stream that got its last token as its engine died: that engine did not live on). Identical
bodies share a fingerprint: a monitoring probe sent again and again is cleared by each of its
answers, and a greedy request that outlived one fault is not refused at the next unrelated one.
An input that kills the engine only after its answer has ended is never in flight at the
death, and is not counted (it never was).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from appliance.core.errors import Unprocessable
from appliance.core.sections import ResumeSettings

log = structlog.get_logger("appliance.recovery.quarantine")

SHOWN = 10  # quarantined fingerprints the status document lists, the newest first


@dataclass
class Suspect:
    """One fingerprint's record: the deaths it was in flight at, and its refusals since."""

    deaths: int
    died_at: float  # the clock at its last death (its time to live counts from there)
    died_wall: float  # the same as wall time, for people
    refused: int = 0
    refused_wall: float | None = None


class Quarantine:
    """Counts engine deaths per fingerprint; refuses a fingerprint that reached the bound."""

    def __init__(self, settings: ResumeSettings, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._after = settings.quarantine_after
        self._ttl_s = settings.quarantine_ttl_s
        self._max = settings.max_quarantined
        self._clock = clock
        self._wall = wall
        self._suspects: OrderedDict[str, Suspect] = OrderedDict()  # least recent death first
        self.listeners: list[Callable[[str], None]] = []  # told of each refusal (the metric)
        self._isolation: asyncio.Lock | None = None  # made on the loop that uses it

    def answered(self, fingerprint: str) -> None:
        """A request with this fingerprint was answered in full by a worker that had it
        through no death: the deaths it was in flight at are not its doing."""
        suspect = self._suspects.pop(fingerprint, None)
        if suspect is not None:
            log.info("request.quarantine_cleared", fingerprint=fingerprint,
                     deaths=suspect.deaths, refused=suspect.refused)

    def died(self, fingerprints: Iterable[str]) -> None:
        """One engine death, with the fingerprints of the requests in flight at it."""
        now, wall = self._clock(), self._wall()
        self._forget(now)
        for fingerprint in dict.fromkeys(fingerprints):  # each once, in order
            suspect = self._suspects.pop(fingerprint, None)
            if suspect is None:
                suspect = Suspect(0, now, wall)
            suspect.deaths, suspect.died_at, suspect.died_wall = suspect.deaths + 1, now, wall
            self._suspects[fingerprint] = suspect
            if suspect.deaths == self._after:
                log.warning("request.quarantine_reached", fingerprint=fingerprint,
                            deaths=suspect.deaths)
        while len(self._suspects) > self._max:
            self._suspects.popitem(last=False)

    @property
    def suspecting(self) -> bool:
        """Whether any request is suspected: while none is (no engine died within the time to
        live, the common case), a request needs no fingerprint to be let through."""
        return bool(self._suspects)

    def check(self, fingerprint: str) -> None:
        """Raises `request_quarantined` if the fingerprint was in flight at enough deaths."""
        if not self._suspects:
            return
        self._forget(self._clock())
        suspect = self._suspects.get(fingerprint)
        if suspect is None or suspect.deaths < self._after:
            return
        suspect.refused += 1
        suspect.refused_wall = self._wall()
        log.warning("request.quarantined", fingerprint=fingerprint, deaths=suspect.deaths,
                    refused=suspect.refused)
        for listener in self.listeners:
            listener(fingerprint)
        raise request_quarantined(fingerprint, suspect.deaths)

    def suspected(self, fingerprint: str) -> bool:
        """Whether the fingerprint was in flight at an engine death not yet forgotten."""
        return fingerprint in self._suspects

    @property
    def isolation(self) -> asyncio.Lock:
        """Held by a suspect sent again, until its answer begins: a request in flight at a
        death goes to the next worker with no other suspect beside it, so that if it is what
        kills the engine, the others are not at its next death too."""
        if self._isolation is None:
            self._isolation = asyncio.Lock()
        return self._isolation

    def snapshot(self) -> dict[str, Any]:
        """The quarantined fingerprints for the status page: how many, and the newest few with
        their deaths, refusals, and when each was last seen at a death or refused."""
        self._forget(self._clock())
        held = [(fingerprint, suspect) for fingerprint, suspect in reversed(self._suspects.items())
                if suspect.deaths >= self._after]
        return {
            "after_deaths": self._after,
            "count": len(held),
            "newest": [{"fingerprint": fingerprint, "deaths": suspect.deaths,
                        "refused": suspect.refused, "last_death_at": round(suspect.died_wall, 1),
                        "last_refused_at": None if suspect.refused_wall is None
                        else round(suspect.refused_wall, 1)}
                       for fingerprint, suspect in held[:SHOWN]],
        }

    def _forget(self, now: float) -> None:
        """Drops the fingerprints whose last death is older than the time to live."""
        while self._suspects:
            fingerprint, oldest = next(iter(self._suspects.items()))
            if now - oldest.died_at < self._ttl_s:
                return
            del self._suspects[fingerprint]


def request_quarantined(fingerprint: str, deaths: int) -> Unprocessable:
    return Unprocessable(
        f"this request was in flight at {deaths} engine failures and is not sent to the engine "
        f"again (fingerprint {fingerprint}); change the request, or ask the operator",
        code="request_quarantined", reason="request_quarantined")
