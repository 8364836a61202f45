"""/metrics after a known sequence of requests shows exactly those counts."""

from __future__ import annotations

import asyncio
import time

import pytest

import appliance.observe.metrics
import appliance.proxy.pump
from appliance.admission.slots import Admission
from appliance.app import create_app
from appliance.core.engine import EngineState
from appliance.core.settings import Settings
from tests.metrics_text import value
from tests.unit.appliance.fakes import FakeEngine, eventually, free_port, serving, upstream

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


class ShiftedClock:
    """perf_counter, moved on by `offset` seconds when the test says."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


async def test_time_to_first_token_runs_from_the_request_through_its_wait_for_a_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock jumps 1000 s while the stream waits in the admission queue: the time to its
    first token includes them (it runs from the request's arrival, not the worker's head)."""
    import httpx

    clock = ShiftedClock()
    monkeypatch.setattr(appliance.observe.metrics, "time", clock)
    monkeypatch.setattr(appliance.proxy.pump, "time", clock)
    admission = Admission(1, queue_max=1, queue_wait_s=60)
    chat = "/v1/chat/completions"
    async with upstream() as (_, url):
        port = free_port()
        app = create_app(Settings(), FakeEngine(url), admission=admission)
        async with serving(app, port), httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            async with admission.slot():
                waiting = asyncio.create_task(client.post(chat, json=CHAT | {"stream": True}))
                await eventually(lambda: admission.queued == 1)
                clock.offset = 1000.0
            assert (await waiting).status_code == 200
            text = (await client.get("/metrics")).text
    assert value(text, "appliance_time_to_first_token_seconds_count", route=chat) == 1
    assert value(text, "appliance_time_to_first_token_seconds_sum", route=chat) >= 1000
