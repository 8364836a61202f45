"""The API over a fake engine view and a real synthetic upstream: status, relay, terminal answers."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from appliance.core.engine import EngineState
from load.kit.synthetic_worker import SyntheticWorker
from tests.unit.appliance.fakes import (
    FakeEngine,
    appliance,
    eventually,
    free_port,
    stream_until_lost,
    upstream,
)

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# Past the 10 s the upstream below takes to finish on its own: an abort is told apart by the
# tokens it generated, not by how soon (the timing is load.bench.reactions's).
NEVER_S = 30.0



@pytest.mark.parametrize("state", [EngineState.STARTING, EngineState.BACKOFF,
                                   EngineState.FAILED, EngineState.DRAINING])
async def test_not_ready_is_503_with_retry_after_in_the_openai_shape(state: EngineState) -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url, state=state)) as client:
        for body in (CHAT, CHAT | {"stream": True}):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 503
            assert response.headers["retry-after"] == "7"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert state.value in error["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["state"] == state.value
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "7"
        assert ready.json() == {"ready": False, "state": state.value}
        assert (await client.get("/livez")).status_code == 200  # alive: the supervisor runs


async def test_ready_health_is_200_and_livez_answers() -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/livez")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and "retry-after" not in ready.headers


async def test_non_streaming_answer_is_passed_through_with_a_request_id() -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "tok " * 4
        assert len(response.headers["x-request-id"]) == 32


async def test_stream_is_relayed_chunk_by_chunk_to_done() -> None:
    body = CHAT | {"max_tokens": 5, "stream": True}
    async with upstream(tokens=5) as (_, url), appliance(FakeEngine(url)) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line]
    assert len(lines) == 7 and lines[-1] == "data: [DONE]"  # the role's event, five tokens


async def test_worker_lost_mid_stream_ends_with_sse_error_and_done() -> None:
    """Resume off (with it on, the stream waits for the next worker: test_relay.py)."""
    engine_url: str
    async with upstream(tokens=500, delay=0.01) as (fake, engine_url):
        engine = FakeEngine(engine_url)
        async with appliance(engine, resume={"enabled": False}) as client:
            lines = await stream_until_lost(
                client, engine, "/v1/chat/completions", CHAT | {"max_tokens": 500, "stream": True},
                after_lines=3)
        assert lines[-1] == "data: [DONE]"
        assert '"code":"engine_lost"' in lines[-2]
        await eventually(lambda: fake.running == 0)  # the upstream request was closed too
        assert engine.watchers == 0  # the relay's subscription went with it


async def test_unreachable_worker_is_503_not_500() -> None:
    """A worker the supervisor still calls ready, whose health probe fails as the exchange did:
    503 after the wait for the supervisor to say otherwise."""
    engine = FakeEngine(f"http://127.0.0.1:{free_port()}", healthy=False)
    async with appliance(engine, resume={"confirm_s": 0.5}) as client:
        for body in (CHAT, CHAT | {"stream": True}):
            response = await client.post("/v1/completions", json={"prompt": "x"} | body)
            assert response.status_code == 503
            assert "retry-after" in response.headers


async def test_client_disconnect_closes_the_upstream_request() -> None:
    async with upstream(tokens=200, delay=0.05) as (fake, url), appliance(FakeEngine(url)) as c:
        request = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 200}))
        await eventually(lambda: fake.running == 1)
        request.cancel()  # the client goes away mid-request, not streaming
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await eventually(lambda: fake.running == 0, within_s=NEVER_S)
    assert fake.generated_tokens < 200, "the upstream request was closed before it finished"


async def test_streaming_client_disconnect_closes_the_upstream_request() -> None:
    async with upstream(tokens=200, delay=0.05) as (fake, url), appliance(FakeEngine(url)) as c:
        async with c.stream("POST", "/v1/chat/completions",
                            json=CHAT | {"max_tokens": 200, "stream": True}) as response:
            async for _ in response.aiter_lines():
                break
        await eventually(lambda: fake.running == 0, within_s=NEVER_S)
    assert fake.generated_tokens < 200, "the upstream request was closed before it finished"


async def test_oversized_body_is_413_in_the_openai_shape() -> None:
    async with upstream() as (_, url), appliance(
        FakeEngine(url), server={"max_body_bytes": 2048}
    ) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"



def _prompts_counted(fake: SyntheticWorker) -> list[dict[str, object]]:
    """The /tokenize calls that counted a request's prompt (not the one-off calibration)."""
    return [p for p in fake.counted if p.get("prompt") or any(
        m.get("content") for m in p.get("messages", []))]


async def test_budget_that_fits_is_forwarded_without_counting_the_prompt() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 100})
        assert response.status_code == 200
        assert "x-max-tokens-clamped" not in response.headers
        assert _prompts_counted(fake) == []


async def test_budget_the_room_cannot_hold_is_clamped_though_the_window_could() -> None:
    """vLLM silently cuts such a budget; the appliance clamps it visibly (header, metric)."""
    long = {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 2000}
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions", json=long)
        assert response.status_code == 200, response.text
        prompt = len(json.dumps(long["messages"])) // 4
        assert response.headers["x-max-tokens-clamped"] == (
            f"requested=2000; applied={2048 - prompt}")
        assert len(_prompts_counted(fake)) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_budget_the_window_cannot_hold_is_clamped_exactly_before_it_is_sent(
    stream: bool,
) -> None:
    body = CHAT | {"max_tokens": 1_000_000, "stream": stream}
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        prompt = len(json.dumps(CHAT["messages"])) // 4  # the fake's own count
        assert response.headers["x-max-tokens-clamped"] == (
            f"requested=1000000; applied={2048 - prompt}")
        assert len(_prompts_counted(fake)) == 1


async def test_default_budget_is_applied_and_clamped_as_a_default() -> None:
    long = {"messages": [{"role": "user", "content": "x" * 8000}]}
    async with upstream() as (_, url), appliance(
        FakeEngine(url), policy={"default_max_tokens": 500}
    ) as client:
        response = await client.post("/v1/chat/completions", json=long)
        assert response.status_code == 200, response.text
        assert response.headers["x-max-tokens-clamped"].endswith("; source=default")


async def test_prompt_that_fills_the_window_is_400_naming_the_context_length() -> None:
    long = {"messages": [{"role": "user", "content": "x" * 9000}], "max_tokens": 10}
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions", json=long)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
