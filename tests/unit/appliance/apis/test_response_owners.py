"""A stored response is its own client's: two named clients over the synthetic worker, one
trying every way to reach or take over the other's response id."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from appliance.apis.responses.response_ids import ResponseIds
from appliance.core.errors import NotFound
from tests.unit.appliance.fakes import FakeEngine, appliance, upstream

pytestmark = pytest.mark.anyio
RESPONSES = {"model": "synthetic", "input": "hi", "max_output_tokens": 4}
KEYS = {"owner": "sk-owner-unit", "other": "sk-other-unit"}
CLIENTS = {"clients": [{"name": name, "key": key} for name, key in KEYS.items()]}


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def not_found(response: httpx.Response, response_id: str) -> dict[str, Any]:
    """The 404 body, with the id taken out: what is left must not depend on whose it is."""
    assert response.status_code == 404, response.text
    error: dict[str, Any] = response.json()["error"]
    return error | {"message": error["message"].replace(response_id, "ID")}


async def test_another_clients_response_is_the_same_404_as_an_unknown_id_everywhere() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url),
                                                    admission=CLIENTS) as client:
        made = await client.post("/v1/responses", json=RESPONSES, headers=auth("owner"))
        theirs = made.json()["id"]
        asked = len(fake.received)
        for response_id, who in ((theirs, "other"), ("resp_never_made", "owner")):
            answers = [
                await client.get(f"/v1/responses/{response_id}", headers=auth(who)),
                await client.post(f"/v1/responses/{response_id}/cancel", headers=auth(who)),
                await client.post("/v1/responses", headers=auth(who), json=RESPONSES | {
                    "previous_response_id": response_id}),
            ]
            shapes = [not_found(answer, response_id) for answer in answers]
            assert [shape["param"] for shape in shapes] == [
                "response_id", "response_id", "previous_response_id"]
            if who == "other":
                foreign = shapes
            else:
                assert shapes == foreign
        assert len(fake.received) == asked  # the worker was never asked
        own = await client.get(f"/v1/responses/{theirs}", headers=auth("owner"))
        assert own.status_code == 200 and own.json()["id"] == theirs
        continued = await client.post("/v1/responses", headers=auth("owner"), json=RESPONSES | {
            "previous_response_id": theirs})
        assert continued.status_code == 200, continued.text


@pytest.mark.parametrize("store", [True, False])
async def test_a_client_cannot_choose_the_id_of_another_clients_response(store: bool) -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url),
                                                    admission=CLIENTS) as client:
        theirs = (await client.post("/v1/responses", json=RESPONSES,
                                    headers=auth("owner"))).json()["id"]
        asked = len(fake.received)
        taken = await client.post("/v1/responses", headers=auth("other"), json=RESPONSES | {
            "request_id": theirs, "store": store, "input": "overwrite it"})
        assert taken.status_code == 400, taken.text
        assert taken.json()["error"]["param"] == "request_id"
        assert len(fake.received) == asked
        again = await client.post("/v1/responses", headers=auth("owner"), json=RESPONSES | {
            "request_id": theirs})
        assert again.status_code == 200  # its own id, its own client's to reuse
        chosen = await client.post("/v1/responses", headers=auth("other"), json=RESPONSES | {
            "request_id": "resp_my_own_choice"})
        assert chosen.status_code == 200 and chosen.json()["id"] == "resp_my_own_choice"
        refused = await client.get("/v1/responses/resp_my_own_choice", headers=auth("owner"))
        assert refused.status_code == 404


async def test_the_oldest_ids_beyond_the_tracked_number_are_nobodys() -> None:
    """An id the appliance forgot is not handed to whoever asks: the worker still has it."""
    async with upstream() as (fake, url), appliance(
            FakeEngine(url), admission=CLIENTS, policy={"max_tracked_responses": 1}) as client:
        first = (await client.post("/v1/responses", json=RESPONSES,
                                   headers=auth("owner"))).json()["id"]
        await client.post("/v1/responses", json=RESPONSES, headers=auth("owner"))
        assert first in fake.stored
        for who in ("owner", "other"):
            gone = await client.get(f"/v1/responses/{first}", headers=auth(who))
            assert gone.status_code == 404


async def test_refused_creates_leave_no_trace_and_a_clients_ids_push_out_only_its_own() -> None:
    """Issue 35 #7: another client's creates, refused by its own limit or admitted past its
    own bound, never make the owner's stored response answer 404."""
    clients = {"clients": [{"name": "owner", "key": KEYS["owner"]},
                           {"name": "other", "key": KEYS["other"], "tokens_per_minute": 1}]}
    async with upstream() as (_fake, url), appliance(
            FakeEngine(url), admission=clients, policy={"max_tracked_responses": 2}) as client:
        mine = (await client.post("/v1/responses", json=RESPONSES,
                                  headers=auth("owner"))).json()["id"]
        made = await client.post("/v1/responses", json=RESPONSES, headers=auth("other"))
        assert made.status_code == 200  # its minute's token is spent now
        await client.get("/metrics")  # its own series are made by the first scrape
        series = None
        for attempt in range(4):
            refused = await client.post("/v1/responses", headers=auth("other"),
                                        json=RESPONSES | {"request_id": f"resp_refused_{attempt}"})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "client_tokens_per_minute"
            metrics = (await client.get("/metrics")).text
            now = sorted(line.rsplit(" ", 1)[0] for line in metrics.splitlines()
                         if line.startswith("appliance_") and "_created" not in line)
            assert series is None or now == series  # no series per refused request
            series = now
        assert "appliance_requests_in_flight 0.0" in metrics
        # A refused id was never recorded: it is anybody's to take, and nobody's to read.
        free = await client.post("/v1/responses", headers=auth("owner"),
                                 json=RESPONSES | {"request_id": "resp_refused_3"})
        assert free.status_code == 200, free.text
        kept = await client.get(f"/v1/responses/{mine}", headers=auth("owner"))
        assert kept.status_code == 200, kept.text


def test_each_client_forgets_its_own_oldest_ids_never_another_clients() -> None:
    ids = ResponseIds(FakeEngine("http://unused"), capacity=2)
    ids.created("mine", "owner", stored=True)
    for number in range(5):
        ids.created(f"theirs_{number}", "other", stored=True)
    ids.reach("mine", "owner", "response_id")  # still known: no 404
    ids.reach("theirs_4", "other", "response_id")
    with pytest.raises(NotFound):
        ids.reach("theirs_2", "other", "response_id")  # its own third-newest: forgotten
    assert len(ids) == 3
