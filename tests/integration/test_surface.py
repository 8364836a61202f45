"""The whole surface vLLM serves, through the appliance, on the real vLLM CPU worker: the real
clients (openai responses, openai-agents' default model, anthropic), each route's policy, the
disconnect abort on the engine's own metric, and each protocol's ending when the worker dies.

The module shares its boot with test_policy (`keyed_appliance`); the test that kills the worker
runs last."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest

from load.kit.appliance import Appliance
from supervisor.engine.stats import parse_engine_stats
from tests.integration.conftest import KEYS

KEY = KEYS[1]
AUTH = {"Authorization": f"Bearer {KEY}"}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64).decode()
HI = [{"role": "user", "content": "Say hi."}]
WINDOW = 2048  # the harness's engine.max_model_len


@pytest.fixture(scope="module")
def surface(keyed_appliance: Appliance) -> Appliance:
    """The appliance with this module's key (shared with test_policy, which runs first)."""
    return keyed_appliance


@pytest.fixture(scope="module")
def model(surface: Appliance) -> str:
    return openai_client(surface).models.list().data[0].id


def openai_client(appliance: Appliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key=KEY, max_retries=0)


def anthropic_client(appliance: Appliance, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=appliance.url, api_key=key, max_retries=0)


def post(appliance: Appliance, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(f"{appliance.url}{path}", json=body, headers=AUTH | headers, timeout=120)


def engine_running(appliance: Appliance) -> float:
    text = appliance.engine_get("/metrics", timeout_s=5).text
    return parse_engine_stats(text).running


def clamp_applied(response: httpx.Response) -> int:
    header = response.headers["x-max-tokens-clamped"]
    assert header.startswith("requested=1000000; applied="), header
    return int(header.split("applied=")[1].split(";")[0])


# --- the real clients -------------------------------------------------------------------------

def test_openai_sdk_responses_create_and_stream(surface: Appliance, model: str) -> None:
    sdk = openai_client(surface)
    answer = sdk.responses.create(model=model, input="What is the capital of France?",
                                  max_output_tokens=16, temperature=0)
    assert answer.status in ("completed", "incomplete") and answer.output_text
    with sdk.responses.stream(model=model, input="Count from one to five.",
                              max_output_tokens=16) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 2 and final.output_text == "".join(deltas)


def test_stored_response_is_retrieved_and_a_synchronous_one_cannot_be_cancelled(
        surface: Appliance, model: str) -> None:
    sdk = openai_client(surface)
    created = sdk.responses.create(model=model, input="Say hi.", max_output_tokens=4)
    assert sdk.responses.retrieve(created.id).id == created.id
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        sdk.responses.cancel(created.id)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.retrieve("resp_never_made")
    assert "restart" in str(missing.value)  # the 404 says where stored responses live


def test_openai_agents_default_model_class_answers(surface: Appliance, model: str) -> None:
    """The Agents SDK's default model class speaks the Responses API."""
    import agents

    agents.set_tracing_disabled(True)  # nothing may leave for the internet
    client = openai.AsyncOpenAI(base_url=f"{surface.url}/v1", api_key=KEY, max_retries=0)
    # The SDK treats a reply cut by its budget as a model failure: room for a whole sentence.
    agent = agents.Agent(name="greeter", instructions="Reply with one short sentence.",
                         model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=96, temperature=0))

    async def run() -> object:
        try:
            return await agents.Runner.run(agent, "Say hello.")
        finally:  # on its own loop: left to the garbage collector, it closes on a later test's
            await client.close()

    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output.strip()  # type: ignore[attr-defined]


def test_anthropic_sdk_messages_create_stream_and_count(surface: Appliance, model: str) -> None:
    sdk = anthropic_client(surface)
    message = sdk.messages.create(model=model, max_tokens=16, messages=HI)  # type: ignore[arg-type]
    assert message.content[0].type == "text" and message.content[0].text
    with sdk.messages.stream(model=model, max_tokens=16, messages=HI) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens > 0
    counted = sdk.messages.count_tokens(model=model, messages=HI)  # type: ignore[arg-type]
    assert counted.input_tokens == message.usage.input_tokens


def test_anthropic_errors_raise_the_sdks_typed_exceptions(surface: Appliance, model: str) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(surface, key="sk-wrong").messages.create(
            model=model, max_tokens=4, messages=HI)  # type: ignore[arg-type]
    response = post(surface, "/v1/messages", {"model": model, "messages": HI})
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": response.json()["error"]["message"]}}
    assert "max_tokens" in response.json()["error"]["message"]


# --- policy on every route --------------------------------------------------------------------

def test_batch_item_with_n_3_is_refused_and_a_batch_is_answered(surface: Appliance,
                                                                 model: str) -> None:
    refused = post(surface, "/v1/chat/completions/batch",
                   {"model": model, "messages": [HI, HI], "n": 3, "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    answered = post(surface, "/v1/chat/completions/batch",
                    {"model": model, "messages": [HI, [{"role": "user", "content": "Bye."}]],
                     "max_tokens": 3})
    assert answered.status_code == 200, answered.text
    assert [c["index"] for c in answered.json()["choices"]] == [0, 1]


def test_invocations_route_by_shape_under_the_same_caps(surface: Appliance, model: str) -> None:
    chat = post(surface, "/invocations", {"model": model, "messages": HI, "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(surface, "/invocations", {"model": model, "prompt": "Hi", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    for body in ({"messages": HI, "n": 3}, {"prompt": "Hi", "best_of": 3}):
        refused = post(surface, "/invocations", {"model": model} | body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == \
            "sequence_limit_exceeded"


def test_responses_max_output_tokens_of_a_million_is_clamped_exactly(surface: Appliance,
                                                                     model: str) -> None:
    response = post(surface, "/v1/responses", {"model": model, "input": "Say hi.",
                                               "max_output_tokens": 10**6, "temperature": 0})
    assert response.status_code == 200, response.text
    assert clamp_applied(response) == WINDOW - response.json()["usage"]["input_tokens"]


def test_messages_max_tokens_of_a_million_is_clamped_exactly(surface: Appliance,
                                                             model: str) -> None:
    response = post(surface, "/v1/messages", {"model": model, "messages": HI,
                                              "max_tokens": 10**6, "temperature": 0})
    assert response.status_code == 200, response.text
    assert clamp_applied(response) == WINDOW - response.json()["usage"]["input_tokens"]


def test_image_block_to_the_text_only_model_is_refused_in_anthropic_shape(
        surface: Appliance, model: str) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    content = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client(surface).messages.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": content}])  # type: ignore[arg-type, list-item]
    assert refused.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "This model accepts text only; 'messages[0].content[1]' is an image part."}}
    remote = {"type": "input_image", "image_url": "http://169.254.169.254/latest/x.png"}
    response = post(surface, "/v1/responses", {"model": model, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What?"}, remote]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[0].content[1]"


def test_tokenizer_routes_version_and_model_retrieve(surface: Appliance, model: str) -> None:
    tokens = post(surface, "/tokenize", {"model": model, "prompt": "Hello world"})
    assert tokens.status_code == 200 and tokens.json()["count"] == len(tokens.json()["tokens"])
    text = post(surface, "/detokenize", {"model": model, "tokens": tokens.json()["tokens"]})
    assert text.status_code == 200 and "Hello world" in text.json()["prompt"]
    info = httpx.get(f"{surface.url}/tokenizer_info", headers=AUTH, timeout=30)
    assert info.status_code == 200, info.text  # engine.tokenizer_info is on by default
    assert info.json()["tokenizer_class"]
    version = httpx.get(f"{surface.url}/version", headers=AUTH, timeout=30)
    assert version.status_code == 200 and version.json()["version"].startswith("0.")
    assert openai_client(surface).models.retrieve(model).id == model


def test_a_body_that_is_not_json_gets_vllms_refusal_in_the_routes_shape(
        surface: Appliance, model: str) -> None:
    body = json.dumps({"model": model, "messages": HI, "max_tokens": 4})
    form = {"content-type": "application/x-www-form-urlencoded"}
    anthropic_answer = httpx.post(f"{surface.url}/v1/messages", content=body, timeout=30,
                                  headers={"x-api-key": KEY} | form)
    assert anthropic_answer.status_code == 400
    assert anthropic_answer.json()["type"] == "error"
    openai_answer = httpx.post(f"{surface.url}/v1/responses", content=body, timeout=30,
                               headers=AUTH | form)
    assert openai_answer.status_code == 400
    assert openai_answer.json()["error"]["code"] == "unsupported_media_type"


# --- disconnect and the worker's death --------------------------------------------------------

def _raw_request(appliance: Appliance, path: str, body: dict[str, object]) -> socket.socket:
    """A client we can drop abruptly: a raw socket that sends the request and then closes."""
    host, port = appliance.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    return sock


LONG = "Write a very long essay about lighthouses."


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("path", "budget"), [("/v1/responses", "max_output_tokens"),
                                              ("/v1/messages", "max_tokens")])
def test_disconnect_aborts_on_the_engine(
        surface: Appliance, model: str, path: str, budget: str, stream: bool) -> None:
    """The request runs on the engine, the client leaves, the engine stops it short of its 1500
    tokens (how soon is load.bench.reactions's to measure)."""
    prompt: dict[str, object] = ({"input": LONG} if path == "/v1/responses"
                                 else {"messages": [{"role": "user", "content": LONG}]})
    idle_by = time.monotonic() + 60  # an earlier test's request may still be aborting
    while engine_running(surface) > 0:
        assert time.monotonic() < idle_by, "the engine never became idle"
        time.sleep(0.05)
    before = surface.engine_stats()
    sock = _raw_request(surface, path, {"model": model, budget: 1500, "ignore_eos": True,
                                        "stream": stream, **prompt})
    deadline = time.monotonic() + 30
    while engine_running(surface) <= before.running:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    sock.close()
    generated = surface.generated_until_idle(before)
    assert generated < 1500, f"{path}: the engine finished all {generated:.0f} tokens: no abort"


def _read_stream(appliance: Appliance, path: str, body: dict[str, object],
                 lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{appliance.url}{path}", json=body, headers=AUTH,
                      timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_worker_killed_mid_stream_ends_each_protocols_stream_and_ids_name_the_restart(
        surface: Appliance, model: str) -> None:
    """Streams that cannot go on from their text (log probabilities, stop sequences: the
    worker's state; tests/integration/test_resume.py has those that can) end in their
    protocol's own error once the client has some of them."""
    stored = openai_client(surface).responses.create(model=model, input="Hi", max_output_tokens=2)
    streams = {
        "/v1/responses": {"model": model, "input": LONG, "max_output_tokens": 1500,
                          "ignore_eos": True, "stream": True, "top_logprobs": 1},
        "/v1/messages": {"model": model, "messages": [{"role": "user", "content": LONG}],
                         "max_tokens": 1500, "stream": True, "stop_sequences": ["\u2603\u2603"]},
    }
    seen: dict[str, list[str]] = {path: [] for path in streams}
    readers = []
    for path, body in streams.items():
        started = threading.Event()
        reader = threading.Thread(target=_read_stream,
                                  args=(surface, path, body, seen[path], started))
        reader.start()
        assert started.wait(60), f"{path}: the stream never started"
        readers.append(reader)
    old_pid = surface.worker_pid()
    os.kill(old_pid, signal.SIGKILL)
    for reader in readers:
        reader.join(30)

    responses_tail = seen["/v1/responses"][-4:]
    assert responses_tail[0] == "event: error" and responses_tail[2] == "event: response.failed"
    failed = json.loads(responses_tail[3].removeprefix("data: "))
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["id"] == json.loads(
        seen["/v1/responses"][1].removeprefix("data: "))["response"]["id"]
    messages_tail = seen["/v1/messages"][-2:]
    assert messages_tail[0] == "event: error"
    assert json.loads(messages_tail[1].removeprefix("data: "))["error"]["type"] == \
        "overloaded_error"

    detail = surface.wait_ready()
    assert detail["pid"] != old_pid
    response = httpx.get(f"{surface.url}/v1/responses/{stored.id}", headers=AUTH, timeout=30)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "response_lost_in_restart" and str(old_pid) in error["message"]
