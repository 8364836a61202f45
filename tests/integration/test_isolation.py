"""Clients kept apart on the real vLLM worker: a stored response is reached only by the client
that made it, and a request the engine worked on is charged whether or not its client waited."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import Appliance, running_appliance

CLIENTS = [
    {"name": "owner", "key": "sk-owner"},
    {"name": "other", "key": "sk-other"},
]


@pytest.fixture(scope="module")
def apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_appliance(Path(tmp_path_factory.mktemp("isolation")),
                           admission__clients=json.dumps(CLIENTS)) as appliance:
        appliance.wait_ready()
        yield appliance


def call(appliance: Appliance, who: str, method: str, path: str,
         body: dict[str, object] | None = None) -> httpx.Response:
    return httpx.request(method, f"{appliance.url}{path}", json=body, timeout=120,
                         headers={"Authorization": f"Bearer sk-{who}"})


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
