"""Admission: how many sequences generation requests may hold at the engine at once, and who
waits.

A request holds as many slots as the sequences it makes the engine run (its fan-out: prompts of
a batch times `n`, appliance.policy.fanout), so a batch of 64 prompts holds what 64 single
requests hold. A request first passes its client's own limits (sequences open, tokens per
minute): over one, it is refused at once with 429 naming the limit and when it resets (a fan-out
above a limit outright is the gate's 400: no wait would ever admit it). Then, for a model with
a cap of its own (`max_inflight` in its `[models.<name>]` table), it takes its slots in that
model's line; then its `max_inflight` slots in the box's line. Each line is a short queue
(admission.queue_max places; admission.queue_wait_s at most for both lines together) served by
priority and round-robin across clients (appliance.admission.line). A request waiting at its
model's cap is in its model's queue only, so it never holds up another model's requests. A
client with a better priority than the default may also take one of
`admission.priority_headroom` slots beyond the box's limit, so that it does not wait for a
low-priority request to finish. A request not admitted in time gets 429 with a Retry-After
estimated from the queue and the mean time a slot is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable, Iterator

from appliance.admission.accounts import Account
from appliance.admission.clients import ANYONE, Client
from appliance.admission.line import Line, Words
from appliance.admission.usage import Meter
from appliance.core.errors import BadRequest
from appliance.core.settings import Settings

_HOLD_WEIGHT = 0.2  # of each new hold time in the running mean
_FIRST_HOLD_S = 1.0  # the mean before any request finished


class _Shared:
    """What every model's view of one admission shares: the clients' accounts, the mean hold
    time, the count of admissions, and the models' own lines (counted in `queued`)."""

    def __init__(self) -> None:
        self.accounts: dict[str, Account] = {}
        self.mean_hold_s = _FIRST_HOLD_S
        self.admitted = 0  # slots granted so far: work the engine was given
        self.model_lines: list[Line] = []


class Admission:
    """In-flight slots; `slot()` is the only way to take one, and its exit the only release.
    `for_model` gives a model with a cap of its own a view of the same admission."""

    def __init__(self, max_inflight: int, *, queue_max: int = 0, queue_wait_s: float = 0.0, headroom: int = 0,
                 default_priority: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        shared = self._shared = _Shared()
        self._line = Line(max_inflight, Words(), lambda: shared.mean_hold_s,
                          queue_max=queue_max, queue_wait_s=queue_wait_s, headroom=headroom,
                          default_priority=default_priority)
        self._model: tuple[str, Line] | None = None
        self._queue_max = queue_max
        self._wait_s = queue_wait_s
        self._default_priority = default_priority
        self._clock = clock

    @classmethod
    def from_settings(cls, settings: Settings) -> Admission:
        admission = settings.admission
        return cls(settings.policy.max_inflight, queue_max=admission.queue_max,
                   queue_wait_s=admission.queue_wait_s, headroom=admission.priority_headroom,
                   default_priority=admission.default_priority)

    def for_model(self, name: str, max_inflight: int | None) -> Admission:
        """This admission with `name`'s own cap in front of it (itself where there is none):
        the box's line, the clients' limits and the hold times stay shared."""
        if max_inflight is None:
            return self
        shared = self._shared
        line = Line(max_inflight, Words(f" for model '{name}'", f" (models.{name}.max_inflight)",
                                        busy="model_max_inflight",
                                        busy_reason="model_max_inflight",
                                        queue_full="model_admission_queue_full",
                                        queue_timeout="model_admission_timeout"),
                    lambda: shared.mean_hold_s, queue_max=self._queue_max,
                    queue_wait_s=self._wait_s, default_priority=self._default_priority)
        shared.model_lines.append(line)
        view = copy.copy(self)
        view._model = (name, line)
        return view

    def model_detail(self) -> dict[str, int] | None:
        """The model's own line, for /health (None without a cap of its own)."""
        if self._model is None:
            return None
        line = self._model[1]
        return {"max_inflight": line.most, "in_flight": line.in_flight, "queued": len(line.queue)}

    @property
    def in_flight(self) -> int:
        return self._line.in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, in the box's line or a model's."""
        return len(self._line.queue) + sum(len(line.queue) for line in self._shared.model_lines)

    @property
    def max_inflight(self) -> int:
        return self._line.most

    @property
    def mean_hold_s(self) -> float:
        return self._shared.mean_hold_s

    @property
    def admitted(self) -> int:
        """Slots granted so far: work the engine was given."""
        return self._shared.admitted

    @contextlib.asynccontextmanager
    async def slot(self, client: Client = ANYONE, prompt_bytes: int = 0, sequences: int = 1,
                   admitted: Callable[[], None] | None = None) -> AsyncIterator[Meter]:
        """Hold `sequences` slots for the block; it yields the meter the request's usage is
        counted on. `admitted` runs once they are held (what a request records only then)."""
        shared = self._shared
        with self.reserved(client, sequences):
            async with self._model_slots(client, sequences) as deadline:
                await self._line.take(client, sequences, deadline)
                shared.admitted += 1
                meter = Meter(client.tokens_per_minute is not None, prompt_bytes)
                started = self._clock()
                try:
                    if admitted is not None:
                        admitted()
                    yield meter
                finally:
                    self._line.give_back(sequences)
                    now = self._clock()
                    shared.mean_hold_s += _HOLD_WEIGHT * (now - started - shared.mean_hold_s)
                    if meter.enabled:
                        shared.accounts[client.name].charge(client, meter.tokens(), now)

    @contextlib.asynccontextmanager
    async def _model_slots(self, client: Client, sequences: int) -> AsyncIterator[float]:
        """The slots in the model's own line, where it has one, held for the block; yields the
        deadline the wait in the box's line has (queue_wait_s covers both waits)."""
        deadline = asyncio.get_running_loop().time() + self._wait_s
        if self._model is None:
            yield deadline
            return
        name, line = self._model
        if sequences > line.most:
            raise BadRequest(f"the request makes the engine run {sequences} sequences at once "
                             f"(prompts x 'n'), more than model '{name}' runs at once "
                             f"(models.{name}.max_inflight, {line.most}); split it into smaller "
                             "requests.", code="too_many_sequences")
        await line.take(client, sequences, deadline)
        try:
            yield deadline
        finally:
            line.give_back(sequences)

    @contextlib.contextmanager
    def reserved(self, client: Client, sequences: int = 1) -> Iterator[None]:
        """The client's sequences held while its request waits before admission (for its
        model's load): its limits checked (429 at once) and the wait counted against them, as
        a place in the admission queue is, so no client fills a queue beyond its own limits."""
        account = self._shared.accounts.setdefault(client.name, Account())
        account.check(client, self._clock(), self._shared.mean_hold_s, sequences)
        account.held += sequences
        try:
            yield
        finally:
            account.held -= sequences

    def retry_after_s(self) -> int:
        """When a request sent now would likely be admitted: the queue ahead, slot by slot."""
        return self._line.retry_after_s()
