"""The quarantine: engine deaths counted per fingerprint, a fingerprint at the bound refused,
fingerprints forgotten after their time to live or past the bound on how many are kept, and
cleared by an answer in full from a worker that lived."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from appliance.core.engine import Waiting
from appliance.core.errors import ApiError
from appliance.core.sections import ResumeSettings
from appliance.recovery.quarantine import Quarantine
from tests.unit.appliance.pending import Pending


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


def test_an_answer_in_full_clears_the_deaths_a_fingerprint_was_in_flight_at() -> None:
    q = quarantine()
    q.died(["innocent", "poison"])
    with capture_logs() as logs:
        q.answered("innocent")
        q.answered("never-suspected")  # nothing to clear, nothing said
    assert [(e["event"], e["fingerprint"], e["deaths"]) for e in logs] == [
        ("request.quarantine_cleared", "innocent", 1)]
    q.died(["innocent", "poison"])
    assert refused(q, "innocent") is None  # its count began again: one death
    assert refused(q, "poison") is not None
    q.answered("poison")  # one of its copies ran to its end after all: it is no poison
    assert refused(q, "poison") is None and q.snapshot()["count"] == 0


class Relayed:
    """The calls one request's relay makes on Waiting and the quarantine, in its order
    (appliance/proxy/relay.py): send, outlive a death (set aside, checked, sent to the next worker),
    leave; and the forensics' description of a death (supervisor/forensics/recorder.py)."""

    def __init__(self, waiting: Waiting, q: Quarantine, body: bytes) -> None:
        self.waiting, self.q, self.body = waiting, q, body

    def send(self) -> None:
        self.waiting.add(self, "req", Pending(self.body, stream=False))
        self.waiting.name(self, self.body)
        if self.q.suspecting:
            self.q.check(self.waiting.fingerprint(self, self.body))

    def outlive_death(self) -> None:
        fingerprint = self.waiting.fingerprint(self, self.body)
        self.waiting.set_aside(self)
        self.q.check(fingerprint)
        self.waiting.add(self, "req", Pending(self.body, stream=False))

    def answered(self) -> None:
        self.waiting.left(self, None)


def death(waiting: Waiting, q: Quarantine) -> None:
    q.died([entry["fingerprint"] for entry in waiting.describe()])


def served(q: Quarantine) -> tuple[Waiting, list[Relayed]]:
    """Eight greedy chat requests, as serve wires Waiting to the quarantine."""
    waiting = Waiting()
    waiting.answered.append(q.answered)
    return waiting, [Relayed(waiting, q, b'{"n": %d}' % n) for n in range(8)]


def test_requests_answered_through_a_kill_are_not_refused_at_the_next_unrelated_fault() -> None:
    q = quarantine()
    waiting, requests = served(q)
    for request in requests:
        request.send()
    death(waiting, q)  # kill -9: all eight in flight
    for request in requests:
        request.outlive_death()
        request.answered()
    for request in requests:  # the same bodies, minutes later
        request.send()
    death(waiting, q)  # EngineCore frozen: all eight in flight again
    for request in requests:
        request.outlive_death()  # not request_quarantined
        request.answered()
    assert q.snapshot()["count"] == 0 and not q.suspecting


def test_an_input_that_kills_every_engine_it_reaches_is_still_refused() -> None:
    q = quarantine()
    waiting, requests = served(q)
    poison, bystander = requests[0], requests[1]
    poison.send()
    bystander.send()
    death(waiting, q)
    bystander.outlive_death()
    bystander.answered()
    poison.outlive_death()
    death(waiting, q)  # the next worker dies with it again: never answered in full
    with pytest.raises(ApiError) as refusal:
        poison.outlive_death()
    assert refusal.value.code == "request_quarantined"


def test_an_answer_from_a_worker_that_died_with_the_request_clears_nothing() -> None:
    """A stream that had its last token as its engine died ends as answered: that engine did
    not live on, so the death still counts against it."""
    q = quarantine()
    waiting, [request, *_] = served(q)
    q.died(["another"])  # a suspect already: the request's fingerprint is taken at its send
    request.send()
    death(waiting, q)
    request.answered()  # the end relayed from what it had, on the dead worker
    request.send()
    death(waiting, q)
    with pytest.raises(ApiError):
        request.outlive_death()
