"""The quarantine: engine deaths counted per fingerprint, a fingerprint at the bound refused,
fingerprints forgotten after their time to live or past the bound on how many are kept."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from appliance.errors import ApiError
from appliance.recovery.quarantine import Quarantine
from appliance.settings import ResumeSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quarantine(clock: Clock | None = None, **settings: object) -> Quarantine:
    clock = clock or Clock()
    return Quarantine(ResumeSettings(**settings),  # type: ignore[arg-type]
                      clock=clock, wall=lambda: clock.now + 1_700_000_000.0)


def refused(q: Quarantine, fingerprint: str) -> ApiError | None:
    try:
        q.check(fingerprint)
    except ApiError as error:
        return error
    return None


def test_a_fingerprint_is_refused_only_once_it_was_in_flight_at_quarantine_after_deaths() -> None:
    q, told = quarantine(), []
    q.listeners.append(told.append)
    q.died(["poison", "bystander"])
    assert refused(q, "poison") is None and refused(q, "bystander") is None
    q.died(["poison"])
    with capture_logs() as logs:
        error = refused(q, "poison")
    assert error is not None and error.status == 422 and error.code == "request_quarantined"
    assert "poison" in error.message and error.reason == "request_quarantined"
    assert [(e["event"], e["fingerprint"], e["deaths"]) for e in logs] == [
        ("request.quarantined", "poison", 2)]
    assert told == ["poison"]
    assert refused(q, "bystander") is None and refused(q, "never-seen") is None


def test_a_death_counts_a_fingerprint_once_however_many_copies_were_in_flight() -> None:
    q = quarantine()
    q.died(["same", "same", "same"])
    assert refused(q, "same") is None


def test_the_bound_is_the_setting() -> None:
    q = quarantine(quarantine_after=3)
    q.died(["x"])
    q.died(["x"])
    assert refused(q, "x") is None
    q.died(["x"])
    assert refused(q, "x") is not None


def test_deaths_are_forgotten_quarantine_ttl_s_after_the_last_one() -> None:
    clock = Clock()
    q = quarantine(clock, quarantine_ttl_s=60.0)
    q.died(["x"])
    clock.now += 59.0
    q.died(["x"])  # the time to live counts from here
    clock.now += 59.0
    assert refused(q, "x") is not None
    clock.now += 1.0
    assert refused(q, "x") is None
    q.died(["x"])  # one death again, not three
    assert refused(q, "x") is None


def test_at_most_max_quarantined_fingerprints_are_kept_the_least_recently_dead_dropped() -> None:
    q = quarantine(max_quarantined=2)
    q.died(["a"])
    q.died(["b"])
    q.died(["a"])  # a is now the most recently dead
    q.died(["c"])  # one too many: b goes
    assert refused(q, "a") is not None
    q.died(["b", "c"])
    assert refused(q, "c") is not None
    assert refused(q, "b") is None  # its first death was forgotten: this is its first again
    assert q.snapshot()["count"] == 1


def test_the_snapshot_shows_the_quarantined_newest_first_with_their_counts_and_times() -> None:
    clock = Clock()
    q = quarantine(clock)
    q.died(["old", "once"])
    q.died(["old"])
    clock.now += 10.0
    q.died(["new"])
    q.died(["new"])
    with pytest.raises(ApiError):
        q.check("new")
    snapshot = q.snapshot()
    assert snapshot["after_deaths"] == 2 and snapshot["count"] == 2
    assert [entry["fingerprint"] for entry in snapshot["newest"]] == ["new", "old"]
    new, old = snapshot["newest"]
    assert new["deaths"] == 2 and new["refused"] == 1
    assert new["last_refused_at"] == new["last_death_at"] == 1_700_001_010.0
    assert old["refused"] == 0 and old["last_refused_at"] is None
