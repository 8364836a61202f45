"""A request's fan-out at the door (issue 35 #8): prompts of a batch, `n` and batch chat lines
count against the in-flight limits; one that alone exceeds a limit is a 400 naming it, before
the worker is asked, never a wait."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.unit.appliance.fakes import FakeEngine, appliance, upstream

pytestmark = pytest.mark.anyio
KEY = "sk-limited-unit"
LIMITED = {"clients": [{"name": "limited", "key": KEY, "max_inflight": 4}]}
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "synthetic", "max_tokens": 2}
CHAT = {"model": "synthetic", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def refusal(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 400, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == "too_many_sequences"
    return error


async def test_a_fanout_over_the_clients_own_limit_is_refused_naming_it() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url), admission=LIMITED) as client:
        cases = [("/v1/completions", COMPLETION | {"prompt": ["x"] * 64}, "prompt"),
                 ("/v1/completions", COMPLETION | {"prompt": [[1, 2]] * 3, "n": 2}, "prompt"),
                 ("/v1/chat/completions/batch",
                  CHAT | {"messages": [CHAT["messages"]] * 5}, "messages")]
        for path, body, param in cases:
            error = refusal(await client.post(path, json=body, headers=AUTH))
            assert error["param"] == param
            assert "client 'limited' max_inflight, 4" in error["message"], error["message"]
        assert fake.received == []  # refused before the worker was asked
        fits = await client.post("/v1/completions", headers=AUTH,
                                 json=COMPLETION | {"prompt": ["x"] * 2, "n": 2})
        assert fits.status_code == 200, fits.text


async def test_a_fanout_over_the_global_limit_is_refused_naming_the_setting() -> None:
    async with upstream() as (fake, url), appliance(
            FakeEngine(url), policy={"max_inflight": 3, "max_n": 4}) as client:
        error = refusal(await client.post("/v1/chat/completions", json=CHAT | {"n": 4}))
        assert error["param"] == "n" and "policy.max_inflight, 3" in error["message"]
        error = refusal(await client.post("/v1/completions",
                                          json=COMPLETION | {"prompt": ["a", "b", "c", "d"]}))
        assert error["param"] == "prompt"
        assert fake.received == []
        fits = await client.post("/v1/chat/completions", json=CHAT | {"n": 3})
        assert fits.status_code == 200, fits.text
