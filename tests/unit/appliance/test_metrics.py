"""/metrics after a known sequence of requests shows exactly those counts."""

from __future__ import annotations

import pytest

from appliance.app import create_app
from appliance.engine import EngineState
from appliance.settings import Settings
from tests.metrics_text import value
from tests.unit.appliance.fakes import FakeEngine, free_port, serving, upstream

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = {"content-type": "application/json"}


async def test_known_sequence_gives_exact_counts() -> None:
    import httpx

    async with upstream() as (_, url):
        engine = FakeEngine(url)
        port = free_port()
        async with serving(create_app(Settings(), engine), port, Settings()), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10
        ) as client:
            chat = "/v1/chat/completions"
            for _ in range(3):
                assert (await client.post(chat, json=CHAT)).status_code == 200
            async with client.stream("POST", chat, json=CHAT | {"stream": True}) as response:
                assert [line async for line in response.aiter_lines()][-2] == "data: [DONE]"
            assert (await client.post(chat, json=CHAT | {"n": 9})).status_code == 400
            assert (await client.post(chat, content=b"{oops", headers=JSON)).status_code == 400
            assert (await client.post(chat, json=CHAT | {"max_tokens": 10**6})).status_code == 200
            engine.state = EngineState.BACKOFF
            assert (await client.post(chat, json=CHAT)).status_code == 503
            engine.state = EngineState.READY
            text = (await client.get("/metrics")).text

    route = {"route": chat}
    assert value(text, "appliance_requests_total", status="200", **route) == 5
    assert value(text, "appliance_requests_total", status="400", **route) == 2
    assert value(text, "appliance_requests_total", status="503", **route) == 1
    assert value(text, "appliance_rejections_total", reason="n_cap") == 1
    assert value(text, "appliance_rejections_total", reason="invalid_json") == 1
    assert value(text, "appliance_rejections_total", reason="engine_unavailable") == 1
    assert value(text, "appliance_max_tokens_clamped_total") == 1
    assert value(text, "appliance_time_to_first_token_seconds_count", **route) == 1
    assert value(text, "appliance_request_duration_seconds_count", **route) == 8
    assert value(text, "appliance_requests_in_flight") == 0
