"""Named clients on the routes beyond chat (Responses, Anthropic Messages, the tokenizer):
the same identification, limits, fair queue and engine priority as chat, every refusal in the
route's own protocol shape (real app, synthetic worker)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from appliance.app import create_app
from appliance.core.settings import Settings
from tests.metrics_text import value
from tests.unit.appliance.fakes import FakeEngine, eventually, free_port, serving, upstream

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": "synthetic", "messages": HI, "max_tokens": 4}
RESPONSES = {"model": "synthetic", "input": "hi", "max_output_tokens": 4}
CHAT = {"messages": HI, "max_tokens": 4}
CLIENTS = [
    {"name": "claude-app", "key": "sk-claude", "max_inflight": 1, "priority": 2},
    {"name": "metered", "key": "sk-metered", "tokens_per_minute": 30},
    {"name": "chat-only", "key": "sk-chat", "routes": ["/v1/chat/completions"]},
]


@contextlib.asynccontextmanager
async def appliance(url: str, policy: dict[str, Any] | None = None, protect: bool = False,
                    **admission: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(server={"protect_ops_routes": protect}, policy=policy or {},
                        admission={"clients": CLIENTS, **admission})
    port = free_port()
    async with serving(create_app(settings, FakeEngine(url)), port, settings), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client


def anthropic_429(response: httpx.Response) -> str:
    assert response.status_code == 429, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert int(response.headers["retry-after"]) >= 1
    return str(body["error"]["message"])


async def test_a_client_named_by_x_api_key_over_its_max_inflight_gets_anthropics_429() -> None:
    """/metrics behind a key (protect_ops_routes) names the client."""
    stream = MESSAGES | {"max_tokens": 200, "stream": True}
    async with upstream(tokens=200, delay=0.02) as (_, url), appliance(
            url, protect=True) as client:
        async with client.stream("POST", "/v1/messages", json=stream,
                                 headers={"x-api-key": "sk-claude"}) as first:
            assert first.status_code == 200
            second = await client.post("/v1/messages", json=MESSAGES,
                                       headers={"x-api-key": "sk-claude"})
        message = anthropic_429(second)
        metrics = (await client.get("/metrics", headers={"Authorization": "Bearer sk-metered"})).text
    assert "claude-app" in message and "max_inflight 1" in message
    assert value(metrics, "appliance_rejections_total", reason="client_max_inflight",
                 client="claude-app") == 1


async def test_a_messages_request_waits_in_the_queue_then_gets_anthropics_429() -> None:
    async with upstream(tokens=100, delay=0.02) as (fake, url), appliance(
            url, policy={"max_inflight": 1}, queue_wait_s=0.2) as client:
        long = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT | {
            "max_tokens": 100}, headers={"Authorization": "Bearer sk-metered"}))
        await eventually(lambda: fake.running == 1)
        refused = await client.post("/v1/messages", json=MESSAGES,
                                    headers={"x-api-key": "sk-claude"})
        assert (await long).status_code == 200
    assert "not admitted within 0.2 s" in anthropic_429(refused)


async def test_responses_and_messages_carry_the_clients_priority_in_vllms_header() -> None:
    async with upstream() as (fake, url), appliance(url) as client:
        bearer = {"Authorization": "Bearer sk-claude"}
        answers = [await client.post("/v1/responses", json=RESPONSES | {"priority": -9},
                                     headers=bearer),
                   await client.post("/v1/messages", json=MESSAGES,
                                     headers={"x-api-key": "sk-claude"})]
    assert [a.status_code for a in answers] == [200, 200]
    assert [path for path, _ in fake.received] == ["/v1/responses", "/v1/messages"]
    assert [h["x-vllm-priority"] for h in fake.headers] == ["2", "2"]
    assert "priority" not in fake.received[0][1]


async def test_a_client_limited_to_chat_is_refused_the_other_routes_in_their_shapes() -> None:
    bearer = {"Authorization": "Bearer sk-chat"}
    async with upstream() as (fake, url), appliance(url) as client:
        responses = await client.post("/v1/responses", json=RESPONSES, headers=bearer)
        messages = await client.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "sk-chat"})
        tokenize = await client.post("/tokenize", json={"prompt": "hi"}, headers=bearer)
        chat = await client.post("/v1/chat/completions", json=CHAT, headers=bearer)
    assert (responses.status_code, tokenize.status_code, chat.status_code) == (403, 403, 200)
    assert responses.json()["error"]["code"] == "route_not_allowed"
    assert messages.status_code == 403
    assert messages.json()["error"] == {"type": "permission_error",
                                        "message": "client 'chat-only' may not use /v1/messages"}
    assert [path for path, _ in fake.received] == ["/v1/chat/completions"]


@pytest.mark.parametrize(("path", "body", "headers"), [
    ("/v1/messages", MESSAGES | {"stream": True}, {"x-api-key": "sk-metered"}),
    ("/v1/messages", MESSAGES, {"x-api-key": "sk-metered"}),
    ("/v1/responses", RESPONSES | {"stream": True}, {"Authorization": "Bearer sk-metered"}),
    ("/v1/responses", RESPONSES, {"Authorization": "Bearer sk-metered"}),
])
async def test_tokens_per_minute_counts_the_usage_anthropic_and_responses_report(
        path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """30 tokens a minute; each request reports 8 (messages) or 1 (responses) prompt tokens and
    20 completion tokens: two pass, the third finds the bucket empty. Charged nothing, none
    would be refused; charged an estimate, the second would be."""
    body = body | ({"max_tokens": 20} if path == "/v1/messages" else {"max_output_tokens": 20})
    async with upstream(tokens=20) as (fake, url), appliance(url) as client:
        answers = [await client.post(path, json=body, headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert "stream_options" not in fake.received[0][1]  # these protocols always report usage
    if body.get("stream"):
        assert b'"usage":{' in answers[0].content  # the client's stream is left as it was
    shape = answers[2].json()
    message = shape["error"]["message"]
    assert "30 tokens per minute" in message
    if path == "/v1/messages":
        assert shape["type"] == "error" and shape["error"]["type"] == "rate_limit_error"
