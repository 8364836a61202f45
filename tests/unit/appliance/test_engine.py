"""The requests the appliance has waiting on the worker: counted cheaply, described on demand."""

from __future__ import annotations

from appliance.engine import Waiting, fingerprint
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
