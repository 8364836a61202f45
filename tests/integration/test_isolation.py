"""Clients kept apart on the real vLLM worker: a stored response is reached only by the client
that made it, and a request the engine worked on is charged whether or not its client waited."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from load.kit.appliance import Appliance, as_client
from supervisor.engine.stats import parse_engine_stats
from tests.metrics_text import value

# A prompt of about 1,800 tokens: its prefill alone takes the engine a while on a CPU. The gate
# counts it exactly (it may not fit the 2,048-token window with its budget).
LONG_PROMPT_WORDS = 1800
LEAVERS = 4  # at most: the refill while the engine works may let a second one through


@pytest.fixture(scope="module")
def apart(clients_appliance: Appliance) -> Appliance:
    """The shared appliance with the named clients (tests/integration/conftest.py's CLIENTS:
    owner, other, and two leavers of 2,500 tokens a minute each: one abandoned long prompt
    leaves some, the second none)."""
    return clients_appliance


def call(appliance: Appliance, who: str, method: str, path: str,
         body: dict[str, object] | None = None) -> httpx.Response:
    return httpx.request(method, f"{appliance.url}{path}", json=body, timeout=120,
                         headers=as_client(who))


def respond(appliance: Appliance, who: str, **body: object) -> httpx.Response:
    return call(appliance, who, "POST", "/v1/responses",
                {"input": "Say hi.", "max_output_tokens": 8} | body)


def test_a_stored_response_is_reached_only_by_its_own_client(apart: Appliance) -> None:
    made = respond(apart, "owner")
    assert made.status_code == 200, made.text
    theirs = made.json()["id"]
    own_text = call(apart, "owner", "GET", f"/v1/responses/{theirs}").json()
    assert own_text["id"] == theirs and own_text["output"]

    unknown = call(apart, "other", "GET", "/v1/responses/resp_never_made")
    for answer in (call(apart, "other", "GET", f"/v1/responses/{theirs}"),
                   call(apart, "other", "POST", f"/v1/responses/{theirs}/cancel"),
                   respond(apart, "other", previous_response_id=theirs)):
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert error["code"] == unknown.json()["error"]["code"] == "response_not_found"
        assert error["message"].replace(theirs, "ID") == \
            unknown.json()["error"]["message"].replace("resp_never_made", "ID")

    taken = respond(apart, "other", request_id=theirs, input="Say bye.")
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "request_id"
    still = call(apart, "owner", "GET", f"/v1/responses/{theirs}").json()
    assert still == own_text  # the worker's copy is the owner's, untouched

    continued = respond(apart, "owner", previous_response_id=theirs)
    assert continued.status_code == 200, continued.text


def engine_busy(appliance: Appliance) -> bool:
    text = appliance.engine_get("/metrics", timeout_s=5).text
    return parse_engine_stats(text).busy


def until(condition: object, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def long_chat(tag: int, stream: bool) -> dict[str, object]:
    """A different first word each time: no prefix of it is cached by the engine."""
    prompt = f"{tag} " + "word " * LONG_PROMPT_WORDS
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 100,
            "stream": stream}


async def leave_while_the_engine_works(appliance: Appliance, who: str, tag: int,
                                       stream: bool) -> None:
    """A stream is left as soon as its head arrives (the engine is still in the prompt's
    prefill: no event yet); a JSON request once the engine holds it."""
    headers = as_client(who)
    async with httpx.AsyncClient(base_url=appliance.url, timeout=120) as client:
        if stream:
            async with client.stream("POST", "/v1/chat/completions", json=long_chat(tag, True),
                                     headers=headers) as response:
                assert response.status_code == 200
            return
        request = asyncio.ensure_future(client.post("/v1/chat/completions",
                                                    json=long_chat(tag, False), headers=headers))
        while not engine_busy(appliance):
            assert not request.done(), request.result().text
            await asyncio.sleep(0.05)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


@pytest.mark.parametrize("stream", [False, True])
def test_requests_abandoned_while_the_engine_works_use_up_their_clients_tokens(
        apart: Appliance, stream: bool) -> None:
    """Each abandoned long prompt charges about 1,800 tokens against 2,500 a minute; the bucket
    refills as the engine works, so on a slow box a third may be needed before the client is
    refused. A bucket that is never charged lets every small request in."""
    who = "leaver-stream" if stream else "leaver-json"
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for tag in range(LEAVERS):
        asyncio.run(leave_while_the_engine_works(apart, who, tag + 10 * stream, stream))
        until(lambda: not engine_busy(apart) and not value(
            httpx.get(f"{apart.url}/metrics", timeout=5).text, "appliance_requests_in_flight"))
        probe = call(apart, who, "POST", "/v1/chat/completions", small)
        if probe.status_code != 200:
            break
    assert tag >= 1, "one abandoned prompt is within the client's minute"
    assert probe.status_code == 429, probe.text
    assert probe.json()["error"]["code"] == "client_tokens_per_minute"
