"""The fault-load clients ask again after a 503 as the SDKs do (load/faults/run.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from load.faults.run import ask

pytestmark = pytest.mark.anyio
ANSWER = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                  "finish_reason": "stop"}]}


def server(statuses: list[int]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        status = statuses.pop(0)
        if status == 503:
            return httpx.Response(503, headers={"retry-after": "0.01"}, json={"error": {}})
        return httpx.Response(200, json=ANSWER)

    return httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(answer))


async def test_a_503_is_asked_again_after_its_retry_after_up_to_the_sdks_count() -> None:
    async with server([503, 200]) as client:
        result = await ask(client, "chat", "p", {}, time.monotonic, retries=2)
    assert result.status == 200 and result.retries == 1 and result.facts is not None
    async with server([503, 503, 503]) as client:
        result = await ask(client, "chat", "p", {}, time.monotonic, retries=2)
    assert result.status == 503 and result.retries == 2  # what the application then sees
    async with server([503]) as client:
        assert (await ask(client, "chat", "p", {}, time.monotonic)).status == 503  # raw
