"""One line at the door: slots up to a limit, and the fair queue of requests waiting for them.

Admission (appliance.admission.slots) keeps one for the whole box (policy.max_inflight) and
one per model with a cap of its own (`max_inflight` in its `[models.<name>]` table). A request
takes its sequences' slots at once when they fit and nobody of its priority or better waits;
otherwise it waits in the queue (queue_max places) until its deadline. Freed slots pass
straight to the next waiter once it fits (the head is never passed over by a smaller request
behind it: a batch is not starved). A full queue drops the heaviest client's newest waiter for a
lighter client, or refuses the request when its own client is the heaviest. A waiter that is
cancelled leaves the queue cleanly, and slots handed to it as it left are passed on.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from appliance.admission.clients import Client
from appliance.admission.fairqueue import FairQueue
from appliance.core.errors import TooManyRequests


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


@dataclass(frozen=True)
class Words:
    """How a line's refusals read: the limit's setting, whose slots they are, the codes."""

    whose: str = ""  # after "sequences in flight", e.g. " for model 'gemma'"
    limit: str = ""  # then the setting, e.g. " (models.gemma.max_inflight)"
    busy: str = "too_many_requests"  # the code where no queue is kept
    busy_reason: str = "admission"
    queue_full: str = "queue_full"
    queue_timeout: str = "queue_timeout"


class Line:
    """`most` slots (`headroom` more for a priority better than `default_priority`) and the
    queue in front of them. `hold_s` gives the mean time a slot is held (Retry-After)."""

    def __init__(self, most: int, words: Words, hold_s: Callable[[], float], *,
                 queue_max: int = 0, queue_wait_s: float = 0.0, headroom: int = 0,
                 default_priority: int = 0) -> None:
        self.most = most
        self.words = words
        self.in_flight = 0
        self.queue: FairQueue[_Waiting] = FairQueue()
        self._hold_s = hold_s
        self._queue_max = queue_max
        self._wait_s = queue_wait_s  # as the refusal names it
        self._headroom = headroom
        self._default_priority = default_priority

    def retry_after_s(self) -> int:
        """When a request sent now would likely be admitted: the queue ahead, slot by slot."""
        return max(1, math.ceil((len(self.queue) + 1) * self._hold_s() / self.most))

    def _capacity(self, priority: int) -> int:
        """Slots a request of this priority may count up to: the headroom is for the better."""
        return self.most + (self._headroom if priority < self._default_priority else 0)

    async def take(self, client: Client, sequences: int, deadline: float) -> None:
        """Take `sequences` slots, waiting in the queue until the loop's clock reads
        `deadline` at the latest; 429 where none came."""
        best_waiting = self.queue.best_priority()
        if self.in_flight + sequences <= self._capacity(client.priority) and (
                best_waiting is None or best_waiting > client.priority):
            self.in_flight += sequences
            return
        loop = asyncio.get_running_loop()
        if self._queue_max == 0 or deadline <= loop.time():
            raise TooManyRequests(f"more than {self.most} sequences in flight{self.words.whose}"
                                  f"{self.words.limit}; retry shortly", code=self.words.busy,
                                  retry_after_s=self.retry_after_s(),
                                  reason=self.words.busy_reason)
        waiter = _Waiter(loop.create_future())
        self._enqueue(_Waiting(waiter, sequences), client)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter.future
        except TimeoutError:
            if waiter.granted():
                return  # the slots came as the time ran out: they are ours
            self.queue.remove(_Waiting(waiter, sequences))
            raise self._refusal(self.words.queue_timeout, f"not admitted within "
                                f"{self._wait_s:g} s (admission.queue_wait_s)") from None
        except asyncio.CancelledError:
            if waiter.granted():
                self.give_back(sequences)  # handed to us as we left: pass them on
            else:
                self.queue.remove(_Waiting(waiter, sequences))
            raise

    def _enqueue(self, waiter: _Waiting, client: Client) -> None:
        """Queue the waiter; a full queue drops the heaviest client's newest waiter for it, or
        refuses it when its own client is the heaviest."""
        if len(self.queue) >= self._queue_max:
            heaviest = self.queue.heaviest()
            if heaviest is None or heaviest[1] <= self.queue.count(client.name) + 1:
                raise self._refusal(self.words.queue_full, f"the admission queue is full "
                                    f"({self._queue_max} waiting, admission.queue_max)")
            victim = self.queue.newest_of(heaviest[0])
            assert victim is not None
            self.queue.remove(victim)
            victim.waiter.future.set_exception(self._refusal(
                self.words.queue_full, "dropped from the full admission queue for a client "
                "with fewer requests waiting"))
        self.queue.push(waiter, client.name, client.priority)

    def give_back(self, sequences: int) -> None:
        """Frees the slots, then admits waiters in turn while the next one fits."""
        self.in_flight -= sequences
        while (next_up := self.queue.peek()) is not None:
            waiting, priority = next_up
            if waiting.waiter.future.done():  # gave up; its task takes no slot
                self.queue.remove(waiting)
                continue
            if self.in_flight + waiting.sequences > self._capacity(priority):
                break  # it waits for more to be freed; nobody passes it
            self.queue.pop()  # that waiter, and its client's turn goes round
            self.in_flight += waiting.sequences
            waiting.waiter.future.set_result(None)

    def _refusal(self, code: str, why: str) -> TooManyRequests:
        retry_after_s = self.retry_after_s()
        return TooManyRequests(f"{why}: {self.in_flight} sequences in flight{self.words.whose}, "
                               f"{len(self.queue)} waiting; retry in {retry_after_s} s",
                               code=code, retry_after_s=retry_after_s, reason=code)
