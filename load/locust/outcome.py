"""What one load-test request ended as, and the tally of all of them that judges a run."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Honest refusals under load: admission is full (429), the engine is restarting (503).
REFUSALS = (429, 503)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def acceptable_status(status: int) -> bool:
    """The run's rule: 2xx, 4xx or 503; anything else (500, 502, 504...) fails it."""
    return 200 <= status < 300 or 400 <= status < 500 or status == 503


@dataclass
class Outcome:
    """One request: its status, whether it got a terminal answer, and its stream timings."""

    scenario: str
    expect: int = 200
    status: int | None = None
    terminal: bool | None = None  # None: the client left on purpose, nothing is owed
    expected: bool = True  # a scenario's extra check (e.g. the clamp header) held
    error: str | None = None  # no HTTP answer at all: timeout, connection reset
    length: int = 0
    sse_errors: int = 0
    tokens: int = 0
    ttft_s: float | None = None
    last_token: float | None = None
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None

    def settle(self, status: int, length: int) -> None:
        """A whole response body was read: that is a terminal answer."""
        self.status, self.length, self.terminal = status, length, True

    def note_token(self, now: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = now - self.started
        self.tokens += 1
        self.last_token = now

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.started - self.ttft_s) / (self.tokens - 1)

    def elapsed_ms(self) -> float:
        if self.ended is None:
            self.ended = time.perf_counter()
        return (self.ended - self.started) * 1000

    def failure(self) -> str | None:
        """Why this request fails the run, or None when its answer was acceptable."""
        if self.error is not None:
            return self.error
        if self.status is None:
            return "no status"
        if not acceptable_status(self.status):
            return f"status {self.status}"
        if self.terminal is False:
            return "no terminal answer"
        if self.status not in (self.expect, *REFUSALS):
            return f"expected {self.expect}, got {self.status}"
        if not self.expected:
            return "expectation unmet"
        return None


class Tally:
    """Listens to locust's request events; the summary it writes is what the run is judged by."""

    def __init__(self) -> None:
        self.by_status: Counter[str] = Counter()
        self.by_scenario: dict[str, Counter[str]] = {}
        self.failures: Counter[str] = Counter()
        self.ttft_ms: list[float] = []
        self.tokens_per_s: list[float] = []
        self.tokens = 0
        self.sse_errors = 0
        self.window: tuple[float, float] | None = None

    def on_request(self, context: dict[str, Any] | None = None, **_: Any) -> None:
        outcome = (context or {}).get("outcome")
        if isinstance(outcome, Outcome):
            self.add(outcome)

    def on_user_error(self, exception: BaseException, **_: Any) -> None:
        self.failures[f"user error: {type(exception).__name__}: {exception}"] += 1

    def add(self, outcome: Outcome) -> None:
        status = str(outcome.status) if outcome.status is not None else "none"
        self.by_status[status] += 1
        self.by_scenario.setdefault(outcome.scenario, Counter())[status] += 1
        reason = outcome.failure()
        if reason is not None:
            self.failures[f"{outcome.scenario}: {reason}"] += 1
        self.sse_errors += outcome.sse_errors
        self.tokens += outcome.tokens
        if outcome.ttft_s is not None:
            self.ttft_ms.append(outcome.ttft_s * 1000)
        tpot = outcome.tpot_s()
        if tpot:
            self.tokens_per_s.append(1 / tpot)
        end = outcome.ended or time.perf_counter()
        low, high = self.window or (outcome.started, end)
        self.window = (min(low, outcome.started), max(high, end))

    def summary(self) -> dict[str, Any]:
        span = (self.window[1] - self.window[0]) if self.window else 0.0
        return {
            "requests": sum(self.by_status.values()),
            "by_status": dict(sorted(self.by_status.items())),
            "by_scenario": {name: dict(sorted(counts.items()))
                            for name, counts in sorted(self.by_scenario.items())},
            "failures": dict(self.failures.most_common()),
            "sse_error_events": self.sse_errors,
            "ttft_ms": {"count": len(self.ttft_ms), "p50": percentile(self.ttft_ms, 50),
                        "p95": percentile(self.ttft_ms, 95)},
            "tokens_per_s_per_stream": {"count": len(self.tokens_per_s),
                                        "p50": percentile(self.tokens_per_s, 50),
                                        "p5": percentile(self.tokens_per_s, 5)},
            "streamed_tokens": self.tokens,
            "streamed_tokens_per_s_aggregate": self.tokens / span if span > 0 else None,
            "passed": not self.failures and bool(self.by_status),
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.summary(), indent=2) + "\n")
