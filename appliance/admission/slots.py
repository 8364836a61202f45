"""Admission: how many sequences generation requests may hold at the engine at once, and who
waits.

A request holds as many slots as the sequences it makes the engine run (its fan-out: prompts of
a batch times `n`, appliance.policy.fanout), so a batch of 64 prompts holds what 64 single
requests hold. A request first passes its client's own limits (sequences open, tokens per
minute): over one, it is refused at once with 429 naming the limit and when it resets (a fan-out
above a limit outright is the gate's 400: no wait would ever admit it). Then it takes its
`max_inflight` slots, or, when too few are free, waits in a short queue (admission.queue_max
places, admission.queue_wait_s at most) served by priority and round-robin across clients
(appliance.fairqueue). Freed slots pass straight to the next waiter once it fits (the head
of the queue is never passed over by a smaller request behind it: a batch is not starved). A
client with a
better priority than the default may also take one of `admission.priority_headroom` slots
beyond the limit, so that it does not wait for a low-priority request to finish. A request not
admitted in time gets 429 with a Retry-After estimated from the queue and the mean time a
slot is held. A waiter that is cancelled (client gone, engine lost) leaves the queue cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NamedTuple

from appliance.admission.accounts import Account
from appliance.admission.clients import ANYONE, Client
from appliance.admission.fairqueue import FairQueue
from appliance.admission.usage import Meter
from appliance.core.errors import TooManyRequests
from appliance.core.settings import Settings

_HOLD_WEIGHT = 0.2  # of each new hold time in the running mean
_FIRST_HOLD_S = 1.0  # the mean before any request finished


class _Waiter:
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def granted(self) -> bool:
        future = self.future
        return future.done() and not future.cancelled() and future.exception() is None


class _Waiting(NamedTuple):
    waiter: _Waiter
    sequences: int


class Admission:
    """In-flight slots; `slot()` is the only way to take one, and its exit the only release."""

    def __init__(self, max_inflight: int, *, queue_max: int = 0, queue_wait_s: float = 0.0, headroom: int = 0,
                 default_priority: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_inflight
        self._headroom = headroom
        self._default_priority = default_priority
        self._in_flight = 0
        self._queue_max = queue_max
        self._wait_s = queue_wait_s
        self._clock = clock
        self._queue: FairQueue[_Waiting] = FairQueue()
        self._accounts: dict[str, Account] = {}
        self.mean_hold_s = _FIRST_HOLD_S
        self.admitted = 0  # slots granted so far: work the engine was given

    @classmethod
    def from_settings(cls, settings: Settings) -> Admission:
        admission = settings.admission
        return cls(settings.policy.max_inflight, queue_max=admission.queue_max,
                   queue_wait_s=admission.queue_wait_s, headroom=admission.priority_headroom,
                   default_priority=admission.default_priority)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def max_inflight(self) -> int:
        return self._max

    @contextlib.asynccontextmanager
    async def slot(self, client: Client = ANYONE, prompt_bytes: int = 0, sequences: int = 1,
                   admitted: Callable[[], None] | None = None) -> AsyncIterator[Meter]:
        """Hold `sequences` slots for the block; it yields the meter the request's usage is
        counted on. `admitted` runs once they are held (what a request records only then)."""
        with self.reserved(client, sequences):
            await self._take(client, sequences)
            self.admitted += 1
            meter = Meter(client.tokens_per_minute is not None, prompt_bytes)
            started = self._clock()
            try:
                if admitted is not None:
                    admitted()
                yield meter
            finally:
                self._give_back(sequences)
                now = self._clock()
                self.mean_hold_s += _HOLD_WEIGHT * (now - started - self.mean_hold_s)
                if meter.enabled:
                    self._accounts[client.name].charge(client, meter.tokens(), now)

    @contextlib.contextmanager
    def reserved(self, client: Client, sequences: int = 1) -> Iterator[None]:
        """The client's sequences held while its request waits before admission (for its
        model's load): its limits checked (429 at once) and the wait counted against them, as
        a place in the admission queue is, so no client fills a queue beyond its own limits."""
        account = self._accounts.setdefault(client.name, Account())
        account.check(client, self._clock(), self.mean_hold_s, sequences)
        account.held += sequences
        try:
            yield
        finally:
            account.held -= sequences

    def retry_after_s(self) -> int:
        """When a request sent now would likely be admitted: the queue ahead, slot by slot."""
        return max(1, math.ceil((len(self._queue) + 1) * self.mean_hold_s / self._max))

    def _capacity(self, priority: int) -> int:
        """Slots a request of this priority may count up to: the headroom is for the better."""
        return self._max + (self._headroom if priority < self._default_priority else 0)

    async def _take(self, client: Client, sequences: int) -> None:
        best_waiting = self._queue.best_priority()
        if self._in_flight + sequences <= self._capacity(client.priority) and (
                best_waiting is None or best_waiting > client.priority):
            self._in_flight += sequences
            return
        if self._queue_max == 0 or self._wait_s <= 0:
            raise TooManyRequests(f"more than {self._max} sequences in flight; retry shortly",
                                  code="too_many_requests", retry_after_s=self.retry_after_s(),
                                  reason="admission")
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        self._enqueue(_Waiting(waiter, sequences), client)
        try:
            async with asyncio.timeout(self._wait_s):
                await waiter.future
        except TimeoutError:
            if waiter.granted():
                return  # the slots came as the time ran out: they are ours
            self._queue.remove(_Waiting(waiter, sequences))
            raise self._refusal("queue_timeout", f"not admitted within {self._wait_s:g} s "
                                "(admission.queue_wait_s)") from None
        except asyncio.CancelledError:
            if waiter.granted():
                self._give_back(sequences)  # handed to us as we left: pass them on
            else:
                self._queue.remove(_Waiting(waiter, sequences))
            raise

    def _enqueue(self, waiter: _Waiting, client: Client) -> None:
        """Queue the waiter; a full queue drops the heaviest client's newest waiter for it, or
        refuses it when its own client is the heaviest."""
        if len(self._queue) >= self._queue_max:
            heaviest = self._queue.heaviest()
            if heaviest is None or heaviest[1] <= self._queue.count(client.name) + 1:
                raise self._refusal("queue_full", f"the admission queue is full "
                                    f"({self._queue_max} waiting, admission.queue_max)")
            victim = self._queue.newest_of(heaviest[0])
            assert victim is not None
            self._queue.remove(victim)
            victim.waiter.future.set_exception(self._refusal(
                "queue_full", "dropped from the full admission queue for a client with fewer "
                "requests waiting"))
        self._queue.push(waiter, client.name, client.priority)

    def _give_back(self, sequences: int) -> None:
        """Frees the slots, then admits waiters in turn while the next one fits."""
        self._in_flight -= sequences
        while (next_up := self._queue.peek()) is not None:
            waiting, priority = next_up
            if waiting.waiter.future.done():  # gave up; its task takes no slot
                self._queue.remove(waiting)
                continue
            if self._in_flight + waiting.sequences > self._capacity(priority):
                break  # it waits for more to be freed; nobody passes it
            self._queue.pop()  # that waiter, and its client's turn goes round
            self._in_flight += waiting.sequences
            waiting.waiter.future.set_result(None)

    def _refusal(self, code: str, why: str) -> TooManyRequests:
        retry_after_s = self.retry_after_s()
        return TooManyRequests(f"{why}: {self._in_flight} sequences in flight, {len(self._queue)} "
                               f"waiting; retry in {retry_after_s} s", code=code,
                               retry_after_s=retry_after_s, reason=code)
