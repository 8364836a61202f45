"""A model's own admission cap through the API, in front of two synthetic workers: smol's
requests beyond its `max_inflight` wait (or get a 429 with Retry-After in the route's shape)
while gemma's go through."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.unit.appliance.test_models import chat, two_models

pytestmark = pytest.mark.anyio


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def smol_admission(client: httpx.AsyncClient) -> dict[str, int]:
    return dict((await client.get("/health")).json()["models"]["smol"]["admission"])


async def test_smols_request_beyond_its_cap_waits_while_gemmas_are_answered() -> None:
    async with two_models(smol={"max_inflight": 1}) as (client, workers, _):
        workers["smol"].delay = 1.0  # each smol answer takes about 4 s: 4 tokens
        first = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "smol", "prompt": "x"}))
        await until(lambda: workers["smol"].received)
        second = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "smol", "prompt": "y"}))
        await asyncio.sleep(0.2)
        assert await smol_admission(client) == {"max_inflight": 1, "in_flight": 1, "queued": 1}
        for _ in range(3):  # the box has room: smol's queue holds none of gemma's up
            answer = await client.post("/v1/chat/completions", json=chat("gemma"))
            assert answer.status_code == 200, answer.text
        assert len(workers["smol"].received) == 1 and not second.done()
        assert (await asyncio.wait_for(first, 10)).status_code == 200
        assert (await asyncio.wait_for(second, 10)).status_code == 200
        assert len(workers["smol"].received) == 2


async def test_without_a_queue_smols_request_beyond_its_cap_is_a_429_in_the_routes_shape(
) -> None:
    async with two_models(smol={"max_inflight": 1},
                          more={"admission": {"queue_max": 0}}) as (client, workers, _):
        workers["smol"].delay = 1.0
        first = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "smol", "prompt": "x"}))
        await until(lambda: workers["smol"].received)
        openai = await client.post("/v1/chat/completions", json=chat("smol"))
        assert openai.status_code == 429 and int(openai.headers["retry-after"]) >= 1
        assert openai.json()["error"]["code"] == "model_max_inflight"
        assert "models.smol.max_inflight" in openai.json()["error"]["message"]
        anthropic = await client.post("/v1/messages", json={
            "model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})
        assert anthropic.status_code == 429 and "retry-after" in anthropic.headers
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        assert (await client.post("/v1/chat/completions", json=chat("gemma"))).status_code == 200
        assert (await asyncio.wait_for(first, 10)).status_code == 200
        assert len(workers["smol"].received) == 1


async def test_the_box_limit_still_holds_beneath_a_models_cap() -> None:
    async with two_models(smol={"max_inflight": 4},
                          more={"admission": {"queue_max": 0},
                                "policy": {"max_inflight": 1}}) as (client, workers, _):
        workers["gemma"].delay = 0.5
        held = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "gemma", "prompt": "x"}))
        await until(lambda: workers["gemma"].received)
        refused = await client.post("/v1/chat/completions", json=chat("smol"))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_requests"  # the box's limit
        assert (await asyncio.wait_for(held, 10)).status_code == 200
        assert not workers["smol"].received
