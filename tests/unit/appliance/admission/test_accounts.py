"""TokenBucket on its own: a continuous refill, a debt the refill pays, the wait it names."""

from __future__ import annotations

import pytest

from appliance.admission.accounts import TokenBucket


def test_a_new_bucket_is_full_and_lets_a_request_in() -> None:
    bucket = TokenBucket(per_minute=600, now=100.0)
    assert bucket.level == 600
    assert bucket.empty_for(100.0) == 0.0


def test_usage_is_charged_once_known_and_may_take_the_level_into_debt() -> None:
    bucket = TokenBucket(per_minute=600, now=0.0)
    bucket.charge(900, now=0.0)
    assert bucket.level == -300
    # 600 per minute is 10 a second: 301 tokens (back above zero) take 30.1 s.
    assert bucket.empty_for(0.0) == pytest.approx(30.1)


def test_the_refill_is_continuous_and_pays_the_debt_before_the_next_request() -> None:
    bucket = TokenBucket(per_minute=600, now=0.0)
    bucket.charge(900, now=0.0)
    assert bucket.empty_for(15.0) == pytest.approx(15.1)
    assert bucket.level == pytest.approx(-150)
    assert bucket.empty_for(30.1) == 0.0
    assert bucket.level == pytest.approx(1)


def test_the_refill_never_holds_more_than_a_minutes_worth() -> None:
    bucket = TokenBucket(per_minute=600, now=0.0)
    bucket.charge(60, now=0.0)
    assert bucket.empty_for(3600.0) == 0.0
    assert bucket.level == 600
    bucket.charge(600, now=3600.0)
    assert bucket.level == 0
    assert bucket.empty_for(3600.0) == pytest.approx(0.1), "a level of zero is not above zero"


def test_the_refill_counts_time_since_the_last_reading_only() -> None:
    """Reading the level twice must not refill twice for the same seconds."""
    bucket = TokenBucket(per_minute=60, now=0.0)
    bucket.charge(60, now=0.0)
    for now in (1.0, 2.0, 2.0, 3.0):
        bucket.empty_for(now)
    assert bucket.level == pytest.approx(3)
