"""Policy at the gate against the real vLLM CPU worker: each rule refuses before the engine,
and the engine stays healthy after every bad request."""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import openai
import pytest

from load.kit.appliance import Appliance
from supervisor.engine.stats import parse_engine_stats
from tests.integration.conftest import KEYS, MAX_INFLIGHT
from tests.metrics_text import samples

KEY = KEYS[0]
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Say hi."}]
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64).decode()


@pytest.fixture(scope="module")
def gated(keyed_appliance: Appliance) -> Appliance:
    """The appliance with this module's key and MAX_INFLIGHT (shared with test_surface)."""
    return keyed_appliance


def post(appliance: Appliance, body: object, path: str = "/v1/chat/completions",
         **kwargs: object) -> httpx.Response:
    return httpx.post(f"{appliance.url}{path}", json=body, headers=AUTH, timeout=120,
                      **kwargs)  # type: ignore[arg-type]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return dict(error)


def engine_running(appliance: Appliance) -> float:
    text = appliance.engine_get("/metrics", timeout_s=5).text
    return parse_engine_stats(text).running


def engine_healthy(appliance: Appliance) -> None:
    assert appliance.health().status_code == 200
    assert post(appliance, {"messages": HI, "max_tokens": 2}).status_code == 200


def test_n_above_the_cap_is_400_naming_n(gated: Appliance) -> None:
    assert_error(post(gated, {"messages": HI, "n": 3, "max_tokens": 2}), 400, "n")
    assert_error(post(gated, {"prompt": "x", "best_of": 5}, "/v1/completions"), 400, "best_of")


def test_n_at_the_cap_gives_that_many_choices(gated: Appliance) -> None:
    response = post(gated, {"messages": HI, "n": 2, "max_tokens": 4, "temperature": 1})
    assert response.status_code == 200
    assert len(response.json()["choices"]) == 2


def test_huge_max_tokens_is_clamped_not_refused(gated: Appliance) -> None:
    response = post(gated, {"messages": HI, "max_tokens": 1_000_000, "temperature": 0})
    assert response.status_code == 200, response.text
    header = response.headers["x-max-tokens-clamped"]
    assert header.startswith("requested=1000000; applied=")
    applied = int(header.split("applied=")[1].split(";")[0])
    prompt = response.json()["usage"]["prompt_tokens"]
    assert applied == 2048 - prompt  # exact: the worker's own count with the chat template
    text = httpx.get(f"{gated.url}/metrics", timeout=5).text
    assert "appliance_max_tokens_clamped_total" in text


def test_max_completion_tokens_is_clamped_too(gated: Appliance) -> None:
    """The clamp is decided before the engine's first byte: a stream's headers carry it, and
    leaving after them spares the sampled answer's up to 2,000 tokens."""
    body = {"messages": HI, "max_completion_tokens": 50_000, "max_tokens": None, "stream": True}
    with httpx.stream("POST", f"{gated.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        header = response.headers["x-max-tokens-clamped"]
    assert header.startswith("requested=50000; applied="), header


def test_prompt_longer_than_the_window_is_400(gated: Appliance) -> None:
    long = [{"role": "user", "content": "word " * 3000}]
    error = assert_error(post(gated, {"messages": long}), 400)
    assert "2048" in error["message"]
    engine_healthy(gated)


def test_image_part_to_the_text_only_model_is_400_and_engine_stays_up(gated: Appliance) -> None:
    message = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
    ]}]
    error = assert_error(post(gated, {"messages": message}), 400)
    assert error["param"].startswith("messages[0].content[1]")
    engine_healthy(gated)


def test_remote_image_url_is_refused(gated: Appliance) -> None:
    for url in ("http://169.254.169.254/latest/meta-data", "http://192.168.1.1/x.png",
                "file:///etc/passwd"):
        message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        assert_error(post(gated, {"messages": message}), 400)
    engine_healthy(gated)


def test_missing_or_wrong_key_is_401_and_ops_routes_stay_open(gated: Appliance) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{gated.url}/v1/chat/completions", json={"messages": HI},
                              headers=headers, timeout=30)
        assert_error(response, 401)
    assert httpx.get(f"{gated.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{gated.url}/health", timeout=10).status_code == 200
    assert KEY not in gated.log_path.read_text()


def test_sdk_with_the_key_works(gated: Appliance) -> None:
    sdk = openai.OpenAI(base_url=f"{gated.url}/v1", api_key=KEY, max_retries=0)
    model = sdk.models.list().data[0].id
    answer = sdk.chat.completions.create(model=model, messages=HI, max_tokens=4,  # type: ignore[arg-type]
                                         extra_body={"top_k": 5})
    assert answer.choices[0].message.content is not None


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": "2"}', "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
])
def test_bad_input_is_400_naming_the_field(gated: Appliance, raw: bytes,
                                           param: str | None) -> None:
    response = httpx.post(f"{gated.url}/v1/chat/completions", content=raw, timeout=30,
                          headers=AUTH | {"content-type": "application/json"})
    assert_error(response, 400, param)


def test_body_over_the_limit_is_413(gated: Appliance) -> None:
    huge = {"messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}
    assert_error(post(gated, huge), 413)
    engine_healthy(gated)


def test_tools_without_a_parser_are_refused(gated: Appliance) -> None:
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    assert_error(post(gated, {"messages": HI, "tools": tools, "tool_choice": "auto"}), 400,
                 "tool_choice")


def test_unknown_valid_fields_pass_through(gated: Appliance) -> None:
    body = {"messages": HI, "max_tokens": 3, "top_k": 3, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.stream("POST", f"{gated.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert any('"usage"' in line and '"completion_tokens"' in line for line in lines[-3:])


def _raw_request(appliance: Appliance, body: bytes) -> socket.socket:
    """A client we can drop abruptly: a raw socket that sends the request and then closes."""
    host, port = appliance.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def disconnects(appliance: Appliance, stream: bool) -> float:
    text = httpx.get(f"{appliance.url}/metrics", timeout=5).text
    return samples(text).get(("appliance_client_disconnects_total",
                              frozenset({("stream", str(stream).lower())})), 0.0)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_on_the_engine(gated: Appliance, stream: bool) -> None:
    """In order: the request runs on the engine, the client leaves, the appliance counts the
    disconnect and the engine stops the request short of its 1500 tokens (how soon is
    load.bench.reactions's to measure)."""
    before, disconnects_before = gated.engine_stats(), disconnects(gated, stream)
    body = (b'{"messages": [{"role": "user", "content": "Write a very long essay."}], '
            b'"max_tokens": 1500, "ignore_eos": true, "stream": ' + str(stream).lower().encode()
            + b"}")
    sock = _raw_request(gated, body)
    deadline = time.monotonic() + 30
    while engine_running(gated) <= before.running:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    sock.close()
    generated = gated.generated_until_idle(before)
    assert generated < 1500, f"the engine finished all {generated:.0f} tokens: no abort"
    assert disconnects(gated, stream) == disconnects_before + 1


def test_admission_beyond_max_inflight_is_429_with_retry_after(gated: Appliance) -> None:
    body = {"messages": HI, "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = threading.Barrier(MAX_INFLIGHT + 1)
    release = threading.Event()
    admitted: list[int] = []

    def hold() -> None:
        with httpx.stream("POST", f"{gated.url}/v1/chat/completions", json=body, headers=AUTH,
                          timeout=120) as response:
            iterator = response.iter_lines()
            next(iterator)
            admitted.append(response.status_code)
            started.wait(60)
            release.wait(120)

    holders = [threading.Thread(target=hold) for _ in range(MAX_INFLIGHT)]
    for thread in holders:
        thread.start()
    try:
        started.wait(120)
        assert admitted == [200] * MAX_INFLIGHT, f"the holders were not all admitted: {admitted}"
        in_flight = samples(httpx.get(f"{gated.url}/metrics", timeout=5).text)
        assert in_flight[("appliance_requests_in_flight", frozenset())] == MAX_INFLIGHT
        response = post(gated, {"messages": HI, "max_tokens": 2})
        assert_error(response, 429)
        assert int(response.headers["retry-after"]) >= 1
    finally:
        release.set()
        for thread in holders:
            thread.join(60)
    engine_healthy(gated)
