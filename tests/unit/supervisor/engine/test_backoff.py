"""Backoff and CrashLoop on their own: the delays between restarts and the window that fails."""

from __future__ import annotations

import pytest

from supervisor.engine.backoff import Backoff, CrashLoop


def _fixed(value: float) -> Backoff:
    return Backoff(initial_s=1.0, max_s=10.0, jitter=0.25, rand=lambda: value)


def test_the_delay_doubles_per_attempt_up_to_the_cap() -> None:
    backoff = _fixed(0.5)  # rand 0.5: no spread
    assert [backoff.next_delay() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_jitter_spreads_each_delay_both_ways_by_at_most_its_fraction() -> None:
    assert _fixed(0.0).next_delay() == pytest.approx(0.75)
    assert _fixed(1.0).next_delay() == pytest.approx(1.25)
    capped = _fixed(1.0)
    delays = [capped.next_delay() for _ in range(6)]
    assert delays[-1] == pytest.approx(12.5), "the cap is spread too, so restarts don't align"


def test_a_delay_is_never_negative_whatever_the_jitter() -> None:
    assert Backoff(initial_s=1.0, max_s=10.0, jitter=2.0, rand=lambda: 0.0).next_delay() == 0.0


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = _fixed(0.5)
    for _ in range(4):
        backoff.next_delay()
    backoff.reset()
    assert backoff.next_delay() == 1.0


def test_the_loop_trips_at_the_limit_within_the_window() -> None:
    loop = CrashLoop(limit=3, window_s=60.0)
    loop.record(0.0)
    loop.record(10.0)
    assert not loop.tripped(10.0)
    loop.record(20.0)
    assert loop.tripped(20.0)


def test_restarts_that_leave_the_window_are_forgotten() -> None:
    loop = CrashLoop(limit=3, window_s=60.0)
    for now in (0.0, 10.0, 20.0):
        loop.record(now)
    assert loop.clears_at() == 60.0
    assert loop.tripped(59.9)
    assert not loop.tripped(60.0), "a restart exactly window_s old has left the window"
    assert loop.clears_at() == 70.0


def test_restarts_spread_wider_than_the_window_never_trip() -> None:
    loop = CrashLoop(limit=2, window_s=5.0)
    for now in (0.0, 5.0, 10.0, 15.0):
        loop.record(now)
        assert not loop.tripped(now)


def test_an_empty_loop_clears_at_once() -> None:
    assert CrashLoop(limit=1, window_s=5.0).clears_at() == 0.0
