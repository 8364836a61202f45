"""Capped exponential backoff with jitter, and the crash-loop window that ends in `failed`."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable


class Backoff:
    """Delay before restart attempt k: initial * 2**k, capped, spread by +/- jitter."""

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        jitter: float,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._initial = initial_s
        self._max = max_s
        self._jitter = jitter
        self._rand = rand
        self._attempt = 0

    def next_delay(self) -> float:
        base = min(self._max, self._initial * 2.0**self._attempt)
        self._attempt += 1
        spread = base * self._jitter * (2 * self._rand() - 1)
        return max(0.0, base + spread)

    def reset(self) -> None:
        self._attempt = 0


class CrashLoop:
    """Remembers restart times; `tripped` once `limit` restarts fall within `window_s`."""

    def __init__(self, limit: int, window_s: float) -> None:
        self._limit = limit
        self._window = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._forget(now)

    def tripped(self, now: float) -> bool:
        self._forget(now)
        return len(self._times) >= self._limit

    def clears_at(self) -> float:
        """When the oldest restart leaves the window, so the loop is no longer tripped."""
        return self._times[0] + self._window if self._times else 0.0

    def _forget(self, now: float) -> None:
        while self._times and now - self._times[0] >= self._window:
            self._times.popleft()
