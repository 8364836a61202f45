"""Admission: how many generation requests may be with the engine at once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from appliance.errors import TooManyRequests


class Admission:
    """In-flight slots; `slot()` is the only way to take one, and its exit the only release."""

    def __init__(self, max_inflight: int, on_change: Callable[[int], None] = lambda _: None) -> None:
        self._max = max_inflight
        self._in_flight = 0
        self._on_change = on_change

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._in_flight >= self._max:
            raise TooManyRequests(f"more than {self._max} requests in flight; retry shortly",
                                  code="too_many_requests", retry_after_s=1, reason="admission")
        self._in_flight += 1
        self._on_change(self._in_flight)
        try:
            yield
        finally:
            self._in_flight -= 1
            self._on_change(self._in_flight)
