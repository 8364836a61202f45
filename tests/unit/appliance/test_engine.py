"""The requests the appliance has waiting on the worker: counted cheaply, described on demand."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import appliance.core.engine
from appliance.core.engine import Waiting, fingerprint
from appliance.core.errors import BadRequest, UpstreamError, engine_lost
from tests.unit.appliance.pending import SECRET, Pending


def test_waiting_counts_each_request_once_and_describes_it_without_its_body() -> None:
    waiting, key = Waiting(), object()
    waiting.add(key, "req-9", Pending(SECRET, stream=False))
    assert len(waiting) == 1 and waiting.sent == 1
    [entry] = waiting.describe()
    assert "body" not in entry and entry["stream"] is False
    assert entry["fingerprint"] == fingerprint("/v1/chat/completions", "team-a", SECRET)
    assert waiting.describe(bodies=True)[0]["body"] == SECRET.decode()
    waiting.discard(key)
    waiting.discard(key)  # the relay's finally may run after an engine loss cleared nothing
    assert len(waiting) == 0 and waiting.sent == 1


def test_a_fingerprint_names_route_client_and_body() -> None:
    base = fingerprint("/v1/chat/completions", "a", b"{}")
    assert base == fingerprint("/v1/chat/completions", "a", b"{}")
    assert len({base, fingerprint("/v1/completions", "a", b"{}"),
                fingerprint("/v1/chat/completions", "b", b"{}"),
                fingerprint("/v1/chat/completions", "a", b"{ }")}) == 4


def test_a_fingerprint_is_fixed_at_the_first_send_whatever_the_body_becomes() -> None:
    """A resumed request is sent again with a changed body: it keeps the name it died under."""
    waiting, key = Waiting(), object()
    request = Pending(SECRET)
    waiting.add(key, "req-9", request)
    first = waiting.fingerprint(key, SECRET)
    assert first == fingerprint("/v1/chat/completions", "team-a", SECRET)
    request.raw = b'{"messages": [], "max_tokens": 3}'
    assert waiting.fingerprint(key, request.raw) == first
    assert waiting.describe()[0]["fingerprint"] == first
    waiting.discard(key)
    waiting.add(key, "req-10", request)  # a new request under the same key is named afresh
    assert waiting.fingerprint(key, request.raw) != first


def test_a_name_is_fixed_at_the_first_send_and_hashed_only_when_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Most requests meet no death and no suspect: their send costs no hash."""
    hashed: list[bytes] = []
    real = appliance.core.engine.fingerprint

    def counted(route: str, client: str, body: bytes) -> str:
        hashed.append(body)
        return real(route, client, body)

    monkeypatch.setattr(appliance.core.engine, "fingerprint", counted)
    waiting, key = Waiting(), object()
    waiting.add(key, "req-9", Pending(SECRET))
    waiting.name(key, SECRET)
    waiting.name(key, b'{"prompt": [1, 2]}')  # sent again, resumed: the first send names it
    assert hashed == []
    assert waiting.fingerprint(key, b"{}") == real("/v1/chat/completions", "team-a", SECRET)
    assert waiting.fingerprint(key, b"{}") == real("/v1/chat/completions", "team-a", SECRET)
    assert hashed == [SECRET]  # once


def hold(waiting: Waiting, raw: bytes, error: BaseException | None = None) -> None:
    """One request through `holding`, ending on `error` (or answered in full)."""
    with (contextlib.suppress(type(error) if error is not None else ()),
          waiting.holding(object(), f"req-{raw!r}", Pending(raw))):
        if error is not None:
            raise error


def test_a_request_the_engine_failed_is_described_once_at_the_next_death() -> None:
    """A crashing worker fails its requests before its exit is seen: they were in flight."""
    waiting = Waiting()
    hold(waiting, b"poison", engine_lost(1))
    hold(waiting, b"refused", BadRequest("no"))  # the client's mistake: nothing to do with it
    hold(waiting, b"left", asyncio.CancelledError())  # the client left, or the death was seen
    assert len(waiting) == 0
    [entry] = waiting.describe()
    assert entry["fingerprint"] == fingerprint("/v1/chat/completions", "team-a", b"poison")
    assert entry["failed"] is True
    assert waiting.describe() == []  # told once: the next death is another


def test_a_failure_is_forgotten_once_a_request_sent_after_it_is_answered() -> None:
    waiting = Waiting()
    with waiting.holding(object(), "req-before", Pending(b"before")):  # sent before the failure
        hold(waiting, b"failed", UpstreamError(500, "EngineCore died", param=None, code=None))
    # answered after the failure, but it was sent before: it proves nothing about the engine
    assert [e["failed"] for e in waiting.describe()] == [True]
    hold(waiting, b"failed", engine_lost(1))
    hold(waiting, b"after")  # sent after the failure and answered: the engine outlived it
    assert waiting.describe() == []


def test_failed_requests_are_kept_up_to_cut_kept() -> None:
    waiting = Waiting(cut_kept=2)
    for n in range(3):
        hold(waiting, f"failed {n}".encode(), engine_lost(1))
    assert [e["fingerprint"] for e in waiting.describe()] == [
        fingerprint("/v1/chat/completions", "team-a", f"failed {n}".encode()) for n in (1, 2)]


def test_a_request_being_checked_is_owed_by_no_engine_yet_in_flight_if_it_died() -> None:
    """While the relay asks whether the worker died under a request, the request is not work
    the engine owes (the progress watch reads len and unanswered), but a death described meanwhile
    still names it; the relay's `checked` puts it back as it was."""
    waiting = Waiting()
    waiting.add("a", "rid-a", Pending(SECRET, stream=False))
    waiting.checking("a")
    assert len(waiting) == 0 and waiting.unanswered() == 0
    assert [entry["request_id"] for entry in waiting.describe()] == ["rid-a"]
    waiting.checked("a")
    assert len(waiting) == 1 and waiting.unanswered() == 1
    waiting.checking("a")
    waiting.discard("a")  # the worker serves: the failure was its own
    assert waiting.describe() == [] and len(waiting) == 0
