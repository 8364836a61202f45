"""Named clients through the whole API (real app, synthetic worker): who they are, what they
may do, what their requests carry to the engine, and what they are told when over a limit."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from appliance.admission.slots import Admission
from appliance.app import create_app
from appliance.core.context import add_request_fields
from appliance.core.settings import Settings
from load.kit.synthetic_worker import FINGERPRINT, SyntheticWorker
from tests.metrics_text import value
from tests.unit.appliance.fakes import FakeEngine, eventually, free_port, serving, upstream

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KEYS = {"flood": "sk-flood", "steady": "sk-steady", "batch": "sk-batch", "plain": "sk-plain",
        "leaver": "sk-leaver"}
CLIENTS = [
    {"name": "flood", "key": KEYS["flood"], "max_inflight": 2},
    {"name": "steady", "key_sha256": hashlib.sha256(KEYS["steady"].encode()).hexdigest(),
     "priority": -1},
    {"name": "batch", "key": KEYS["batch"], "tokens_per_minute": 60, "max_tokens": 3,
     "routes": ["/v1/chat/completions"], "priority": 7},
    {"name": "leaver", "key": KEYS["leaver"], "tokens_per_minute": 200},
]



def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@contextlib.asynccontextmanager
async def appliance(url: str, policy: dict[str, Any] | None = None, protect: bool = False,
                    **admission: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(server={"api_keys": [KEYS["plain"]], "protect_ops_routes": protect},
                        policy=policy or {}, admission={"clients": CLIENTS, **admission})
    port = free_port()
    async with serving(create_app(settings, FakeEngine(url)), port, settings), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client


async def test_a_client_over_its_max_inflight_gets_429_naming_it_while_others_are_served() -> None:
    """/metrics behind a key (protect_ops_routes) names each client."""
    body = CHAT | {"max_tokens": 200, "stream": True}
    async with upstream(tokens=200, delay=0.02) as (_fake, url), appliance(
            url, protect=True) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=auth("flood")) as one, \
                client.stream("POST", "/v1/chat/completions", json=body,
                              headers=auth("flood")) as two:
            assert one.status_code == two.status_code == 200
            third = await client.post("/v1/chat/completions", json=CHAT, headers=auth("flood"))
            other = await client.post("/v1/chat/completions", json=CHAT, headers=auth("steady"))
        assert third.status_code == 429 and other.status_code == 200
        error = third.json()["error"]
        assert error["code"] == "client_max_inflight" and "max_inflight 2" in error["message"]
        assert error["type"] == "rate_limit_error" and int(third.headers["retry-after"]) >= 1
        metrics = (await client.get("/metrics", headers=auth("plain"))).text
    assert value(metrics, "appliance_rejections_total", reason="client_max_inflight",
                 client="flood") == 1
    assert value(metrics, "appliance_requests_total", status="429", client="flood") == 1
    assert value(metrics, "appliance_requests_total", status="200", client="steady") == 1


async def test_an_open_metrics_page_counts_named_clients_together_and_names_none() -> None:
    """Anyone may scrape an open /metrics: it must not tell who uses the box and how much."""
    async with upstream() as (_fake, url), appliance(url) as client:
        for who in ("flood", "steady", "plain"):
            assert (await client.post("/v1/chat/completions", json=CHAT,
                                      headers=auth(who))).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": "hi"},
                                  headers=auth("batch"))).status_code == 403
        metrics = (await client.get("/metrics")).text
    assert not any(f'"{name}"' in metrics for name in ("flood", "steady", "batch"))
    assert value(metrics, "appliance_requests_total", status="200", client="named") == 2
    assert value(metrics, "appliance_requests_total", status="200", client="anonymous") == 1
    assert value(metrics, "appliance_rejections_total", reason="route_not_allowed",
                 client="named") == 1


async def test_every_log_line_of_a_request_names_its_client_and_never_its_key() -> None:
    async with upstream() as (_, url), appliance(url) as client:
        with capture_logs(processors=[add_request_fields]) as logs:
            await client.post("/v1/chat/completions", json=CHAT, headers=auth("steady"))
            await client.post("/v1/chat/completions", json=CHAT, headers=auth("plain"))
    completed = [entry for entry in logs if entry["event"] == "request.completed"]
    assert [entry["client"] for entry in completed] == ["steady", "anonymous"]
    for secret in KEYS.values():
        assert secret not in str(logs)


async def test_a_route_the_client_is_not_allowed_is_403_before_anything_reaches_the_engine() -> None:
    async with upstream() as (fake, url), appliance(url) as client:
        refused = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth("batch"))
        models = await client.get("/v1/models", headers=auth("batch"))
    assert refused.status_code == models.status_code == 403
    assert refused.json()["error"]["code"] == "route_not_allowed"
    assert not fake.received


async def test_the_engine_gets_the_clients_priority_and_ceiling_not_the_clients_own() -> None:
    """The priority goes in vLLM's X-Vllm-Priority header (read over the body on every
    generation route); a priority the client put in the body is taken out."""
    async with upstream() as (fake, url), appliance(url) as client:
        response = await client.post("/v1/chat/completions", headers=auth("batch"),
                                     json=CHAT | {"max_tokens": 50, "priority": -1000})
        await client.post("/v1/chat/completions", json=CHAT, headers=auth("plain"))
    assert response.status_code == 200
    assert response.headers["x-max-tokens-clamped"] == "requested=50; applied=3"
    assert fake.received[0][1]["max_tokens"] == 3 and "priority" not in fake.received[0][1]
    assert [headers["x-vllm-priority"] for headers in fake.headers] == ["7", "0"]


async def test_a_client_cannot_pick_its_engine_priority_by_header_either() -> None:
    """vLLM 0.32 takes X-Vllm-Priority over the body's priority: the client's never reaches it."""
    async with upstream() as (fake, url), appliance(url) as client:
        await client.post("/v1/chat/completions", json=CHAT,
                          headers=auth("batch") | {"X-Vllm-Priority": "-1000"})
    assert fake.headers[0]["x-vllm-priority"] == "7"


async def test_without_priority_scheduling_the_body_keeps_what_the_client_sent() -> None:
    async with upstream() as (fake, url), appliance(url, priority_scheduling="off") as client:
        await client.post("/v1/chat/completions", json=CHAT | {"priority": 3},
                          headers=auth("batch"))
    assert fake.received[0][1]["priority"] == 3  # vLLM answers for it (a 400 without priorities)
    assert "x-vllm-priority" not in fake.headers[0]


async def test_tokens_per_minute_counts_the_usage_of_streams_the_client_sees_unchanged() -> None:
    """batch: 60 tokens a minute; a request is 8 prompt tokens (the synthetic worker counts 4
    characters a token) and 3 completion tokens: the seventh finds the bucket empty."""
    body = CHAT | {"stream": True}
    async with upstream() as (fake, url), appliance(url) as client:
        statuses = []
        for _ in range(10):
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers=auth("batch")) as response:
                statuses.append(response.status_code)
                if response.status_code == 429:
                    error = json.loads(await response.aread())["error"]
                    break
                lines = [line async for line in response.aiter_lines() if line]
    assert statuses == [200] * 6 + [429]
    assert fake.received[0][1]["stream_options"] == {"include_usage": True}
    assert not any('"usage"' in line for line in lines)
    assert lines[-2].endswith(f'"system_fingerprint":"{FINGERPRINT}"}}')  # as vLLM sends it
    assert error["code"] == "client_tokens_per_minute" and "60 tokens per minute" in error["message"]
    assert "resets in" in error["message"] and int(response.headers["retry-after"]) >= 1


async def test_non_streamed_usage_counts_too() -> None:
    async with upstream() as (_, url), appliance(url) as client:
        codes = [(await client.post("/v1/chat/completions", json=CHAT,
                                    headers=auth("batch"))).status_code for _ in range(7)]
    assert codes == [200] * 6 + [429]


@pytest.mark.parametrize("stream", [False, True])
async def test_requests_their_client_abandoned_are_charged_what_they_cost(stream: bool) -> None:
    """leaver: 200 tokens a minute; a prompt of about 170 tokens (estimated from its bytes),
    the answer never waited for: the second abandoned request takes the bucket below zero."""
    body = {"messages": [{"role": "user", "content": "x" * 600}], "max_tokens": 100,
            "stream": stream}
    async with upstream(tokens=100, delay=0.05) as (fake, url), appliance(url) as client:
        for _ in range(2):
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body,
                                                        headers=auth("leaver")))
            await eventually(lambda: fake.running == 1)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            await eventually(lambda: fake.running == 0)
            # The slot's release and the charge are one step: once nothing is in flight, the
            # request was charged.
            for _ in range(500):
                if not value((await client.get("/metrics")).text, "appliance_requests_in_flight"):
                    break
                await asyncio.sleep(0.01)
        refused = await client.post("/v1/chat/completions", json=body, headers=auth("leaver"))
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "client_tokens_per_minute"


async def test_requests_beyond_every_slot_wait_in_the_queue_and_are_all_served() -> None:
    body = CHAT | {"max_tokens": 20}
    async with upstream(tokens=20, delay=0.01) as (fake, url), appliance(
            url, policy={"max_inflight": 1}) as client:
        requests = [client.post("/v1/chat/completions", json=body, headers=auth(who))
                    for who in ("steady", "steady", "plain", "flood")]
        responses = await asyncio.gather(*requests)
    assert [r.status_code for r in responses] == [200] * 4
    assert fake.running == 0


async def test_a_waiter_that_is_never_admitted_gets_429_with_retry_after_from_the_queue() -> None:
    async with upstream(tokens=100, delay=0.02) as (fake, url), appliance(
            url, policy={"max_inflight": 1}, queue_wait_s=0.2) as client:
        long = asyncio.ensure_future(client.post("/v1/chat/completions", headers=auth("steady"),
                                                 json=CHAT | {"max_tokens": 100}))
        await eventually(lambda: fake.running == 1)
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=auth("plain"))
        assert (await long).status_code == 200
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "queue_timeout" and "1 sequences in flight" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1


@contextlib.asynccontextmanager
async def one_slot(url: str) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine, Admission]]:
    settings = Settings(policy={"max_inflight": 1}, admission={"queue_wait_s": 30},
                        resume={"enabled": False})  # a loss ends the requests (as with resume off)
    engine, admission, port = FakeEngine(url), Admission.from_settings(settings), free_port()
    async with serving(create_app(settings, engine, admission=admission), port, settings), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client, engine, admission


async def one_running_one_queued(client: httpx.AsyncClient, fake: SyntheticWorker, admission: Admission,
                                 ) -> tuple[asyncio.Future[httpx.Response],
                                            asyncio.Future[httpx.Response]]:
    """A long request holding the only slot, and a second one waiting in the queue behind it."""
    long = asyncio.ensure_future(client.post("/v1/chat/completions",
                                             json=CHAT | {"max_tokens": 100}))
    await eventually(lambda: fake.running == 1)
    waiting = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
    await eventually(lambda: admission.queued == 1)
    return long, waiting


async def test_a_queued_request_whose_client_leaves_gives_up_its_place() -> None:
    async with upstream(tokens=100, delay=0.02) as (fake, url), one_slot(url) as (
            client, _, admission):
        long, waiting = await one_running_one_queued(client, fake, admission)
        waiting.cancel()
        await eventually(lambda: admission.queued == 0)
        assert (await long).status_code == 200
        await eventually(lambda: admission.in_flight == 0)


async def test_a_queued_request_gets_503_when_the_engine_is_lost() -> None:
    async with upstream(tokens=100, delay=0.02) as (fake, url), one_slot(url) as (
            client, engine, admission):
        long, waiting = await one_running_one_queued(client, fake, admission)
        engine.fire_lost()
        refused, first = await waiting, await long
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert first.status_code == 503
    assert admission.queued == 0 and admission.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_slot_is_given_back_before_the_client_sees_the_end(stream: bool) -> None:
    """A client's next request must never find its previous one still holding a slot: the
    answer's last message goes out only after the slot is released."""
    settings = Settings(policy={"max_inflight": 1})
    async with upstream(tokens=4) as (_, url):
        admission = Admission.from_settings(settings)
        app = create_app(settings, FakeEngine(url), admission=admission)
        in_flight_at_end: list[int] = []

        async def spy(scope: Any, receive: Any, send: Any) -> None:
            async def sending(message: Any) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    in_flight_at_end.append(admission.in_flight)
                await send(message)
            await app(scope, receive, sending)

        transport = httpx.ASGITransport(app=spy)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            response = await client.post("/v1/chat/completions", json=CHAT | {"stream": stream})
    assert response.status_code == 200
    assert in_flight_at_end == [0]
