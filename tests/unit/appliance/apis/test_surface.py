"""The routes beyond chat and completions over a fake engine view and the synthetic upstream:
each answers in its protocol's shape, with the gate's policy, the relay's endings and counts."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from appliance.core.engine import EngineState
from appliance.fences.vllm import DEV_PATHS
from load.kit.synthetic_sleep import SleepRoutes
from tests.unit.appliance.fakes import (
    FakeEngine,
    appliance,
    eventually,
    stream_until_lost,
    upstream,
)

pytestmark = pytest.mark.anyio
KEY = "sk-surface-unit-key"
HI = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": "synthetic", "messages": HI, "max_tokens": 4}
RESPONSES = {"model": "synthetic", "input": "hi", "max_output_tokens": 4}
PNG = "iVBORw0KGgoAAAAAAAAAAAAAAAA="




def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return str(body["error"]["message"])


# --- Anthropic Messages -----------------------------------------------------------------------

async def test_messages_answer_and_accept_x_api_key_or_bearer() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url),
                                                    server={"api_keys": [KEY]}) as client:
        for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
            response = await client.post("/v1/messages", json=MESSAGES, headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["content"][0]["text"] == "tok " * 4
        for headers in ({}, {"x-api-key": "sk-wrong"}):
            refused = await client.post("/v1/messages", json=MESSAGES, headers=headers)
            anthropic_error(refused, 401, "authentication_error")
        openai_route = await client.post("/v1/chat/completions", headers={"x-api-key": KEY},
                                         json={"messages": HI})
        assert openai_route.status_code == 401  # x-api-key is the Anthropic routes' header only
        assert openai_route.json()["error"]["type"] == "authentication_error"
        assert [path for path, _ in fake.received] == ["/v1/messages", "/v1/messages"]


async def test_every_gate_refusal_on_messages_is_in_anthropic_shape() -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url),
                                                 server={"max_body_bytes": 2048}) as client:
        missing = await client.post("/v1/messages", json={"model": "m", "messages": HI})
        assert "max_tokens" in anthropic_error(missing, 400, "invalid_request_error")
        form = await client.post("/v1/messages", content=json.dumps(MESSAGES),
                                 headers={"content-type": "application/x-www-form-urlencoded"})
        assert "application/json" in anthropic_error(form, 400, "invalid_request_error")
        huge = await client.post("/v1/messages", json=MESSAGES | {
            "messages": [{"role": "user", "content": "x" * 5000}]})
        anthropic_error(huge, 413, "request_too_large")
    async with upstream() as (_, url), appliance(FakeEngine(url, state=EngineState.STARTING)) \
            as client:
        down = await client.post("/v1/messages", json=MESSAGES)
        anthropic_error(down, 503, "overloaded_error")
        assert down.headers["retry-after"] == "7"


async def test_messages_beyond_admission_is_429_rate_limit_error_in_anthropic_shape() -> None:
    async with upstream(tokens=200, delay=0.05) as (fake, url), appliance(
            FakeEngine(url), policy={"max_inflight": 1}) as client:
        held = asyncio.create_task(client.post("/v1/messages", json=MESSAGES | {
            "max_tokens": 200}))
        await eventually(lambda: fake.running == 1)
        refused = await client.post("/v1/messages", json=MESSAGES)
        anthropic_error(refused, 429, "rate_limit_error")
        assert refused.headers["retry-after"] == "1"
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_image_block_to_a_text_only_model_never_reaches_the_engine() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    body = MESSAGES | {"messages": [{"role": "user", "content": [image]}]}
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        message = anthropic_error(await client.post("/v1/messages", json=body), 400,
                                  "invalid_request_error")
        assert message == "This model accepts text only; 'messages[0].content[0]' is an image part."
        counted = await client.post("/v1/messages/count_tokens", json=body)
        anthropic_error(counted, 400, "invalid_request_error")
        assert fake.received == []


async def test_messages_stream_lost_mid_way_ends_with_an_anthropic_error_event() -> None:
    """With resume off (on, the stream waits for the next engine: test_anthropic_resume.py)."""
    async with upstream(tokens=500, delay=0.01) as (fake, url):
        engine = FakeEngine(url)
        async with appliance(engine, resume={"enabled": False}) as client:
            lines = await stream_until_lost(
                client, engine, "/v1/messages", MESSAGES | {"max_tokens": 500, "stream": True},
                after_lines=6)  # the message's and its block's starts, a token
        assert lines[-2] == "event: error"
        data = json.loads(lines[-1].removeprefix("data: "))
        assert data["type"] == "error" and data["error"]["type"] == "overloaded_error"
        await eventually(lambda: fake.running == 0)


async def test_messages_budget_is_clamped_with_the_workers_count_tokens() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/messages", json=MESSAGES | {"max_tokens": 10**6})
        assert response.status_code == 200, response.text
        prompt = len(json.dumps(HI)) // 4  # the fake's count_tokens
        assert response.headers["x-max-tokens-clamped"] == (
            f"requested=1000000; applied={2048 - prompt}")
        assert fake.received[-1][1]["max_tokens"] == 2048 - prompt


# --- Responses --------------------------------------------------------------------------------

async def test_responses_get_an_id_the_appliance_knows_and_are_retrieved() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        created = await client.post("/v1/responses", json=RESPONSES)
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]
        assert response_id.startswith("resp_") and fake.received[-1][1]["request_id"] == \
            response_id
        retrieved = await client.get(f"/v1/responses/{response_id}")
        assert retrieved.status_code == 200 and retrieved.json()["id"] == response_id
        cancel = await client.post(f"/v1/responses/{response_id}/cancel")
        assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"]


async def test_a_response_id_from_before_a_restart_is_a_404_naming_the_restart() -> None:
    async with upstream() as (fake, url):
        engine = FakeEngine(url, pid=100)
        async with appliance(engine) as client:
            response_id = (await client.post("/v1/responses", json=RESPONSES)).json()["id"]
            engine.pid = 200
            fake.stored.clear()  # what the new worker knows
            for call in (client.get(f"/v1/responses/{response_id}"),
                         client.post(f"/v1/responses/{response_id}/cancel"),
                         client.post("/v1/responses", json=RESPONSES | {
                             "previous_response_id": response_id})):
                lost = await call
                assert lost.status_code == 404, lost.text
                error = lost.json()["error"]
                assert error["code"] == "response_lost_in_restart"
                assert "pid 100" in error["message"] and "pid 200" in error["message"]
            unknown = await client.get("/v1/responses/resp_never")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "response_not_found"


async def test_responses_stream_lost_mid_way_ends_with_error_and_response_failed() -> None:
    """With resume off (on, the stream waits for the next engine: test_responses_resume.py)."""
    async with upstream(tokens=500, delay=0.01) as (fake, url):
        engine = FakeEngine(url)
        async with appliance(engine, resume={"enabled": False}) as client:
            lines = await stream_until_lost(
                client, engine, "/v1/responses",
                RESPONSES | {"max_output_tokens": 500, "stream": True},
                after_lines=10)  # the four events before the text, a token
        created = json.loads(lines[1].removeprefix("data: "))
        assert lines[-4:-3] == ["event: error"] and lines[-2] == "event: response.failed"
        error = json.loads(lines[-3].removeprefix("data: "))
        failed = json.loads(lines[-1].removeprefix("data: "))
        last_seen = max(json.loads(line.removeprefix("data: "))["sequence_number"]
                        for line in lines[:-4] if line.startswith("data: "))
        assert error["code"] == "engine_lost" and error["sequence_number"] == last_seen + 1
        assert failed["sequence_number"] == last_seen + 2
        assert failed["response"]["id"] == created["response"]["id"]
        assert failed["response"]["status"] == "failed"
        assert "[DONE]" not in "".join(lines)
        await eventually(lambda: fake.running == 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_budget_is_clamped_with_the_workers_render(stream: bool) -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/responses", json=RESPONSES | {
            "max_output_tokens": 10**6, "stream": stream})
        assert response.status_code == 200, response.text
        prompt = len("hi") // 4 or 1
        assert response.headers["x-max-tokens-clamped"] == (
            f"requested=1000000; applied={2048 - prompt}")


async def test_background_responses_and_their_restreaming_are_refused_unless_allowed() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        refused = await client.post("/v1/responses", json=RESPONSES | {"background": True})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "background"
        restream = await client.get("/v1/responses/resp_x", params={"stream": "true"})
        assert restream.status_code == 400 and restream.json()["error"]["param"] == "stream"
        assert fake.received == []
    async with upstream() as (fake, url), appliance(
            FakeEngine(url), policy={"allow_background_responses": True}) as client:
        allowed = await client.post("/v1/responses", json=RESPONSES | {"background": True})
        assert allowed.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_client_disconnect_closes_the_upstream_request(stream: bool) -> None:
    body = RESPONSES | {"max_output_tokens": 200, "stream": stream}
    async with upstream(tokens=200, delay=0.05) as (fake, url), appliance(FakeEngine(url)) as c:
        request = asyncio.create_task(c.post("/v1/responses", json=body))
        await eventually(lambda: fake.running == 1)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await eventually(lambda: fake.running == 0, within_s=0.5)


# --- batch, invocations, tokenizer ------------------------------------------------------------

async def test_batch_caps_n_bounds_conversations_and_guards_each_ones_media() -> None:
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    async with upstream() as (fake, url), appliance(
            FakeEngine(url), policy={"max_batch_prompts": 2}) as client:
        n3 = await client.post("/v1/chat/completions/batch", json={"messages": [HI], "n": 3})
        assert n3.status_code == 400 and n3.json()["error"]["param"] == "n"
        many = await client.post("/v1/chat/completions/batch", json={"messages": [HI] * 3})
        assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_prompts"
        media = await client.post("/v1/chat/completions/batch", json={"messages": [
            HI, [{"role": "user", "content": [image]}]]})
        assert media.json()["error"]["param"] == "messages[1][0].content[0]"
        wrong = await client.post("/v1/chat/completions/batch", json={"messages": [
            HI, [{"role": "wizard", "content": "x"}]]})
        assert wrong.json()["error"]["param"] == "messages[1][0].role"
        assert fake.received == []
        answered = await client.post("/v1/chat/completions/batch",
                                     json={"messages": [HI, HI], "max_tokens": 3})
        assert [c["index"] for c in answered.json()["choices"]] == [0, 1]


async def test_batch_budget_is_clamped_to_its_longest_conversation() -> None:
    long = [{"role": "user", "content": "x" * 4000}]
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/chat/completions/batch",
                                     json={"messages": [HI, long], "max_tokens": 2000})
        assert response.status_code == 200, response.text
        longest = len(json.dumps(long)) // 4
        assert response.headers["x-max-tokens-clamped"] == (
            f"requested=2000; applied={2048 - longest}")


async def test_invocations_take_the_rules_of_the_shape_they_carry() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        chat = await client.post("/invocations", json={"messages": HI, "max_tokens": 2})
        completion = await client.post("/invocations", json={"prompt": "hi", "max_tokens": 2})
        assert chat.status_code == completion.status_code == 200
        assert [path for path, _ in fake.received] == ["/v1/chat/completions", "/v1/completions"]
        for body in ({"messages": HI, "n": 3}, {"prompt": "hi", "best_of": 3},
                     {"prompt": "hi", "n": 5, "use_beam_search": True}):
            refused = await client.post("/invocations", json=body)
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "sequence_limit_exceeded"
        neither = await client.post("/invocations", json={"input": "hi"})
        assert neither.status_code == 400
        assert neither.json()["error"]["code"] == "unknown_request_shape"
        assert len(fake.received) == 2


async def test_tokenize_takes_a_slot_and_the_media_guard() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://192.168.1.1/x.png"}}
    async with upstream(tokens=200, delay=0.05) as (fake, url), appliance(
            FakeEngine(url), policy={"max_inflight": 1}) as client:
        counted = await client.post("/tokenize", json={"prompt": "hello world"})
        assert counted.status_code == 200 and counted.json()["count"] == 2
        media = await client.post("/tokenize", json={
            "messages": [{"role": "user", "content": [image]}]})
        assert media.status_code == 400 and media.json()["error"]["code"] == \
            "multimodal_not_supported"
        neither = await client.post("/tokenize", json={"model": "m"})
        assert neither.status_code == 400
        held = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 200}))
        await eventually(lambda: fake.running == 1)
        assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 429
        assert (await client.get("/version")).status_code == 200  # relayed: no slot
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_detokenize_version_and_tokenizer_info_are_relayed() -> None:
    async with upstream() as (_, url), appliance(FakeEngine(url)) as client:
        text = await client.post("/detokenize", json={"tokens": [1, 2]})
        assert text.json() == {"prompt": "1 2"}
        bad = await client.post("/detokenize", json={"tokens": ["a"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert (await client.get("/version")).json() == {"version": "0.32.0-synthetic"}
        info = await client.get("/tokenizer_info")
        assert info.status_code == 404 and info.json()["error"]["code"] == "not_enabled"


async def test_a_responses_input_that_fills_the_window_is_400_naming_input() -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post("/v1/responses", json=RESPONSES | {
            "input": "x" * 9000, "max_output_tokens": 10})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "input" and error["code"] == "context_length_exceeded"
        assert fake.received == []


async def test_clients_never_reach_the_workers_sleep_mode_or_other_dev_routes() -> None:
    """A sleeping model's worker serves vLLM's dev routes on its private socket; the API has
    no route to any of them, whatever the method or key."""
    async with upstream() as (fake, url), appliance(FakeEngine(url),
                                                    server={"api_keys": [KEY]}) as client:
        fake.sleep = SleepRoutes()
        auth = {"authorization": f"Bearer {KEY}"}
        for path in DEV_PATHS:
            for method in ("GET", "POST"):
                answer = await client.request(method, path + "?level=1", headers=auth)
                assert answer.status_code in (404, 405), (method, path, answer.status_code)
        answered = await client.post("/v1/chat/completions", headers=auth,
                                     json={"messages": HI, "max_tokens": 2})
        assert answered.status_code == 200  # the worker is reached where a route leads to it
        assert fake.sleep.calls == [] and not fake.sleep.sleeping
