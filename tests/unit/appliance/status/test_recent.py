"""The in-memory ring behind the status page's charts: bounded, rates from counter differences."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from appliance.core.sections import StatusSettings
from appliance.observe.metrics import RequestMetrics
from appliance.status.recent import Recent
from tests.unit.appliance.fakes import FakeReading as Reading


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def make(**status: float) -> tuple[Recent, RequestMetrics, Clock, list[Reading | None]]:
    metrics, clock = RequestMetrics(CollectorRegistry()), Clock()
    engine: list[Reading | None] = [Reading()]
    recent = Recent(StatusSettings(**status), metrics, lambda: 3, lambda: engine[0], clock)
    return recent, metrics, clock, engine


def tick(recent: Recent, clock: Clock, seconds: float = 1.0) -> None:
    clock.now += seconds
    recent.sample()


def test_the_ring_holds_history_s_over_sample_interval_s_samples() -> None:
    recent, _, clock, _ = make(history_s=10, sample_interval_s=0.5)
    for _ in range(100):
        tick(recent, clock, 0.5)
    assert len(recent.samples) == 20
    assert recent.samples[-1].at - recent.samples[0].at == pytest.approx(9.5)


def test_tokens_per_second_is_the_engine_counters_rise_over_the_window() -> None:
    recent, _, clock, engine = make(rate_window_s=4)
    for tokens in (0, 10, 20, 30, 40, 50):
        engine[0] = Reading(generation_tokens=tokens)
        tick(recent, clock)
    rates = recent.series()["tokens_per_s"]
    assert rates[0] is None  # one sample: no difference yet
    assert rates[1:] == [10.0, 10.0, 10.0, 10.0, 10.0]
    engine[0] = Reading(generation_tokens=90)  # a burst: 70 tokens over the last 4 s
    tick(recent, clock)
    assert recent.series()["tokens_per_s"][-1] == pytest.approx((90 - 20) / 4)


def test_no_rate_while_the_engine_gives_no_reading_or_its_counter_starts_again() -> None:
    recent, _, clock, engine = make(rate_window_s=2)
    engine[0] = Reading(generation_tokens=500)
    tick(recent, clock)
    engine[0] = None  # restarting: not ready, no reading
    tick(recent, clock)
    engine[0] = Reading(generation_tokens=5)  # the new worker counts from zero
    tick(recent, clock)
    tick(recent, clock)
    assert recent.series()["tokens_per_s"] == [None, None, None, None]
    tick(recent, clock)
    assert recent.series()["tokens_per_s"][-1] == 0.0


def test_ttft_is_the_mean_of_first_tokens_seen_in_the_window_across_routes() -> None:
    recent, metrics, clock, _ = make(rate_window_s=2)
    tick(recent, clock)
    metrics.first_token("/v1/chat/completions", 0.2)
    metrics.first_token("/v1/completions", 0.4)
    tick(recent, clock)
    tick(recent, clock)
    tick(recent, clock)
    series = recent.series()
    assert series["ttft_s"] == [None, pytest.approx(0.3), pytest.approx(0.3), None]
    assert series["in_flight"] == [3, 3, 3, 3]
    assert recent.mean_ttft() == pytest.approx(0.3)
