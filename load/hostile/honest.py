"""An honest client measured while attacks run: /livez latency, polled at a prober's pace."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

POLL_PERIOD_S = 0.02
MIN_SAMPLES = 100  # about 2.5 s of polling: a p99 that one scheduler hiccup does not decide


@dataclass
class Latencies:
    seconds: list[float] = field(default_factory=list)
    failures: int = 0  # polls that got no 200 (an error, a timeout, a refusal)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    @property
    def worst(self) -> float:
        return max(self.seconds, default=0.0)

    def __str__(self) -> str:
        return (f"p50 {self.quantile(0.5) * 1000:.0f} ms, p99 {self.p99 * 1000:.0f} ms, "
                f"failed {self.failures}/{len(self.seconds) + self.failures}")


def poll_livez_during(url: str, attacks: Sequence[Callable[[], object]],
                      timeout_s: float = 30.0) -> Latencies:
    """Run the attacks in threads and poll `url`/livez until they have all ended (and at least
    MIN_SAMPLES times); each poll's latency, and how many failed."""
    threads = [threading.Thread(target=attack, daemon=True) for attack in attacks]
    result = Latencies()
    with httpx.Client(base_url=url, timeout=timeout_s, trust_env=False) as client:
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads) or len(result.seconds) < MIN_SAMPLES:
            started = time.perf_counter()
            try:
                ok = client.get("/livez").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                result.seconds.append(time.perf_counter() - started)
            else:
                result.failures += 1
            time.sleep(POLL_PERIOD_S)
        for thread in threads:
            thread.join(timeout_s)
    return result
