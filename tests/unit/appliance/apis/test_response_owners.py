"""A stored response is its own client's: two named clients over the synthetic worker, one
trying every way to reach or take over the other's response id."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

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
