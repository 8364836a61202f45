"""The last minutes of serving, kept in memory: counters sampled on a timer into a ring.

Nothing here runs per request or per chunk. Once per `status.sample_interval_s` a sample reads
cumulative counters that exist anyway: the engine's own generated-token counter (the reading
the progress monitor takes each second while there is work), the appliance's
time-to-first-token totals over every route, and the in-flight count. Rates and means over
`status.rate_window_s` are derived from differences of those counters only when someone asks
(`series()`), so a page nobody watches costs one sample a second.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.core.sections import StatusSettings


class EngineCounters(Protocol):
    """The worker's own gauges and counters, as the supervisor last read them."""

    @property
    def running(self) -> float: ...

    @property
    def waiting(self) -> float: ...

    @property
    def generation_tokens(self) -> float: ...


EngineReading = Callable[[], EngineCounters | None]


class TtftTotals(Protocol):
    """Time to first token, summed and counted over every route (RequestMetrics)."""

    @property
    def ttft_sum(self) -> float: ...

    @property
    def ttft_count(self) -> int: ...


@dataclass(frozen=True)
class Sample:
    at: float  # wall clock, for the page's time axis
    generated: float | None  # the engine's generation-token counter; None: no reading
    ttft_sum: float  # cumulative over every route
    ttft_count: float
    in_flight: int


class Recent:
    """A bounded ring of samples and what the page derives from it."""

    def __init__(self, settings: StatusSettings, ttft: TtftTotals, in_flight: Callable[[], int],
                 engine: EngineReading, clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._ttft = ttft
        self._in_flight = in_flight
        self._engine = engine
        self._clock = clock
        size = max(2, round(settings.history_s / settings.sample_interval_s))
        self.samples: deque[Sample] = deque(maxlen=size)

    def sample(self) -> None:
        reading = self._engine()
        self.samples.append(Sample(self._clock(),
                                   reading.generation_tokens if reading is not None else None,
                                   self._ttft.ttft_sum, self._ttft.ttft_count, self._in_flight()))

    async def run(self) -> None:
        """Sample until cancelled (the app's lifespan owns this task)."""
        while True:
            self.sample()
            await asyncio.sleep(self._settings.sample_interval_s)

    def series(self) -> dict[str, Any]:
        """Columns for the charts: time, tokens/s and mean TTFT over the window ending at
        each sample (None where unknown: no engine reading, a restart, no first token)."""
        samples = list(self.samples)
        window = self._settings.rate_window_s
        times: list[float] = []
        rates: list[float | None] = []
        ttfts: list[float | None] = []
        start = 0
        for end, last in enumerate(samples):
            while start < end and samples[start + 1].at <= last.at - window:
                start += 1
            first = samples[start]
            times.append(round(last.at, 1))
            rates.append(_rate(first, last))
            ttfts.append(_mean_ttft(first, last))
        return {"t": times, "tokens_per_s": rates, "ttft_s": ttfts,
                "in_flight": [s.in_flight for s in samples]}

    def mean_ttft(self) -> float | None:
        """Mean time to first token over everything the ring holds."""
        return _mean_ttft(self.samples[0], self.samples[-1]) if self.samples else None


def _rate(first: Sample, last: Sample) -> float | None:
    if first.generated is None or last.generated is None or last.at <= first.at:
        return None
    if last.generated < first.generated:
        return None  # a new worker: its counter started again from zero
    return round((last.generated - first.generated) / (last.at - first.at), 2)


def _mean_ttft(first: Sample, last: Sample) -> float | None:
    count = last.ttft_count - first.ttft_count
    if count <= 0:
        return None
    return round((last.ttft_sum - first.ttft_sum) / count, 4)
