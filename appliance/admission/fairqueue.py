"""The admission queue's order: priority first, then round-robin across clients, FIFO within one.

A pure structure (no clock, no I/O) so that its fairness is tested exactly. Lower priority values
are served first, as in vLLM. Within a priority, each client with waiters has one place in a
ring: it is served one request, then goes to the back, so a client with 100 waiters delays a
client with 1 by at most one request. A full queue makes room by dropping the newest waiter of
the client that holds the most places, never by refusing the lighter client.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class FairQueue(Generic[T]):
    """Waiters of type T, each under a (priority, client)."""

    def __init__(self) -> None:
        # priority -> the ring of clients (its order is whose turn it is) -> their waiters
        self._classes: dict[int, OrderedDict[str, deque[T]]] = {}
        self._where: dict[T, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def push(self, item: T, client: str, priority: int) -> None:
        ring = self._classes.setdefault(priority, OrderedDict())
        ring.setdefault(client, deque()).append(item)
        self._where[item] = (priority, client)

    def peek(self) -> tuple[T, int] | None:
        """The next waiter to serve and its priority, left in place."""
        if not self._classes:
            return None
        priority = min(self._classes)
        return next(iter(self._classes[priority].values()))[0], priority

    def pop(self) -> T | None:
        """The next waiter to serve: best priority, the client whose turn it is, its oldest."""
        if not self._classes:
            return None
        priority = min(self._classes)
        ring = self._classes[priority]
        client, waiters = next(iter(ring.items()))
        item = waiters.popleft()
        ring.move_to_end(client)  # its next waiter, if any, after every other client's
        self._forget(item, priority, client, waiters)
        return item

    def best_priority(self) -> int | None:
        return min(self._classes) if self._classes else None

    def remove(self, item: T) -> bool:
        """Take out a waiter that gave up (timeout, disconnect); False if it is not queued."""
        place = self._where.get(item)
        if place is None:
            return False
        priority, client = place
        waiters = self._classes[priority][client]
        waiters.remove(item)
        self._forget(item, priority, client, waiters)
        return True

    def count(self, client: str) -> int:
        return sum(len(ring.get(client, ())) for ring in self._classes.values())

    def heaviest(self) -> tuple[str, int] | None:
        """The client holding the most places and how many (ties: the worse priority's)."""
        best: tuple[str, int] | None = None
        for priority in sorted(self._classes, reverse=True):
            for client in self._classes[priority]:
                held = self.count(client)
                if best is None or held > best[1]:
                    best = (client, held)
        return best

    def newest_of(self, client: str) -> T | None:
        """The client's most recently queued waiter in its worst priority class."""
        for priority in sorted(self._classes, reverse=True):
            waiters = self._classes[priority].get(client)
            if waiters:
                return waiters[-1]
        return None

    def _forget(self, item: T, priority: int, client: str, waiters: deque[T]) -> None:
        del self._where[item]
        if not waiters:
            ring = self._classes[priority]
            del ring[client]
            if not ring:
                del self._classes[priority]
