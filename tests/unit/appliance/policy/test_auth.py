"""Bearer authentication against configured keys: constant-time and silent about keys.
(With no key configured the API is open: the clients table says so, test_clients.py.)"""

from __future__ import annotations

import hmac

import pytest

from appliance.apis.openai.api import OPENAI
from appliance.core.errors import Unauthorized
from appliance.policy.auth import digest, match_key

KEYS = ["sk-first-key", "sk-second-key"]


def check_bearer(authorization: str | None, keys: list[str]) -> int:
    return match_key(authorization, [digest(key) for key in keys])


def refusal(authorization: str | None, keys: list[str]) -> Unauthorized:
    with pytest.raises(Unauthorized) as caught:
        check_bearer(authorization, keys)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    assert caught.value.kind == "authentication_error"
    return caught.value


@pytest.mark.parametrize("key", KEYS)
def test_any_configured_key_is_accepted_and_named_by_its_index(key: str) -> None:
    assert check_bearer(f"Bearer {key}", KEYS) == KEYS.index(key)


@pytest.mark.parametrize("authorization", ["bearer sk-first-key", "  Bearer   sk-first-key  "])
def test_the_scheme_is_case_insensitive_and_whitespace_is_tolerated(authorization: str) -> None:
    check_bearer(authorization, KEYS)


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "sk-first-key", "Basic sk-first-key", "Token sk-first-key"],
    ids=["none", "empty", "scheme-only", "scheme-space", "no-scheme", "basic", "token"],
)
def test_a_missing_bearer_token_is_refused(authorization: str | None) -> None:
    refusal(authorization, KEYS)


@pytest.mark.parametrize(
    "token", ["sk-first-ke", "sk-first-key2", "SK-FIRST-KEY", "sk-first-key sk-second-key", "ключ"]
)
def test_a_wrong_key_is_refused(token: str) -> None:
    refusal(f"Bearer {token}", KEYS)


def test_an_empty_configured_key_never_matches() -> None:
    refusal("Bearer ", ["", "real"])
    refusal("Bearer  ", [""])


def test_messages_never_contain_a_key() -> None:
    for authorization in (None, "Bearer sk-wrong-presented"):
        error = refusal(authorization, KEYS)
        text = str(OPENAI.body(error, None)) + str(error)
        assert "sk-" not in text


def test_every_key_is_compared_even_when_the_first_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    check_bearer("Bearer sk-first-key", [*KEYS, "sk-third-key"])
    assert len(calls) == 3
    assert {len(a) for a, _ in calls} | {len(b) for _, b in calls} == {32}
