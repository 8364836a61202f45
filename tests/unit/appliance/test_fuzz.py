"""Properties: whatever a client sends, to any route, in any header, on the wire, the answer is
never a 5xx, a refusal is in the OpenAI error shape, and /livez stays fast.

ROUTES is the one list to extend when a route is added: every property below draws from it.
In-process properties go through the ASGI app (fast, many examples); wire properties write raw
bytes to `chat-appliance serve` over the synthetic worker (garbage request lines, bad framing,
bad chunked encoding, pipelining), where the HTTP server itself is part of what is tested.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from appliance.app import create_app
from appliance.core.settings import Settings
from load.kit.rawclient import Conn, Reply, Stalled, request_head
from tests.support.stack import Stack, running_stack
from tests.unit.appliance.edge.shapes import EXTRA, SHAPE
from tests.unit.appliance.fakes import FakeEngine, upstream

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(
    allow_nan=False) | st.text(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "n", "best_of", "max_tokens", "max_completion_tokens",
          "stream", "temperature", "top_p", "tools", "tool_choice", "logprobs", "top_logprobs",
          "truncate_prompt_tokens", "thinking", "chat_template_kwargs", "use_beam_search"]
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"])},
                              optional={"text": values, "image_url": values})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | values},
    optional={"content": st.text(max_size=30) | st.lists(parts, max_size=3) | values}),
    max_size=3)
bodies = st.fixed_dictionaries({}, optional={"messages": messages | values,
                                             **{f: values for f in FIELDS[2:]}})
raw = st.binary(max_size=64) | bodies.map(lambda b: json.dumps(b).encode())
no_body = st.just(b"") | st.binary(max_size=16)  # GET routes: most clients send nothing


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    bodies: st.SearchStrategy[bytes]
    valid: bytes = b""  # one body the route serves (200), for pipelining


CHAT_OK = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
ROUTES = [
    Route("POST", "/v1/chat/completions", raw, CHAT_OK),
    Route("POST", "/v1/completions", raw, b'{"prompt": "hi", "max_tokens": 2}'),
    Route("GET", "/v1/models", no_body),
    Route("GET", "/health", no_body),
    Route("GET", "/livez", no_body),
    Route("GET", "/metrics", no_body),
]
CHAT, COMPLETIONS = ROUTES[0], ROUTES[1]
HEADER_NAMES = ["X-Request-Id", "Content-Type", "Authorization", "Accept", "Accept-Encoding",
                "X-Forwarded-For", "Cookie", "Expect", "X-Anything"]
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters=
                                      "\x7f"), max_size=64).map(lambda text: text.encode("latin-1"))
header_sets = st.lists(st.tuples(st.sampled_from(HEADER_NAMES), header_values), max_size=4)
requests = st.one_of(*(st.tuples(st.just(route), route.bodies, header_sets) for route in ROUTES))
LIVEZ_SINGLE_S = 1.0  # /livez after each wire example (the edge suite holds the p99)


def assert_answer(status: int, content_type: str, body: bytes) -> None:
    """Never a 5xx; a JSON refusal is in the OpenAI error shape."""
    assert status < 500, (status, body[:300])
    if status >= 400 and content_type.startswith("application/json"):
        error: dict[str, Any] = json.loads(body)["error"]
        assert SHAPE <= set(error) <= SHAPE | EXTRA, error


async def _send(route: Route, body: bytes, headers: list[tuple[str, bytes]]) -> httpx.Response:
    async with upstream() as (_, url):
        app = create_app(Settings(), FakeEngine(url))
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            sent = [("content-type", b"application/json"), *headers]
            return await client.request(route.method, route.path, content=body or None,
                                        headers=[(k.encode(), v) for k, v in sent])


@pytest.mark.anyio
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests)
async def test_no_request_to_any_route_makes_a_5xx(
        request: tuple[Route, bytes, list[tuple[str, bytes]]]) -> None:
    """Any body and headers, to any route in ROUTES: never a 5xx; refusals in the OpenAI shape."""
    route, body, headers = request
    response = await _send(route, body, headers)
    assert_answer(response.status_code, response.headers.get("content-type", ""),
                  response.content)


hostile_scalars = scalars | st.integers(10**30, 10**400) | st.text(
    st.characters(categories=["Cs"]), min_size=1, max_size=3)
hostile_values = st.recursive(hostile_scalars, lambda inner: st.lists(inner, max_size=3)
                              | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                              max_leaves=6)
hostile_bodies = st.fixed_dictionaries({"max_tokens": st.just(10**6)}, optional={
    f: hostile_values for f in [*FIELDS, "logit_bias", "prompt_embeds", "structured_outputs"]
    if f != "max_tokens"}).map(lambda b: json.dumps(b).encode())


@pytest.mark.anyio
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from([CHAT, COMPLETIONS]), body=hostile_bodies)
@example(route=CHAT, body=b'{"messages": [{"role": "user", "content": "\\ud800"}], '
                          b'"max_tokens": 1000000}')
@example(route=COMPLETIONS, body=b'{"prompt": null, "prompt_embeds": "AAAA", '
                                 b'"max_tokens": 1000000}')
async def test_no_hostile_value_makes_a_5xx(route: Route, body: bytes) -> None:
    """#6: lone surrogates, huge integers and odd fields beside a budget the worker refuses
    (so the gate recounts the prompt): never a 5xx, refusals in the OpenAI shape."""
    response = await _send(route, body, [])
    assert_answer(response.status_code, response.headers.get("content-type", ""),
                  response.content)


# On the wire, against the real server.

@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("fuzz"))) as stack:
        yield stack


token = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"),
                min_size=1, max_size=12)
garbage = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH",
                           b"CONNECT", b"TRACE"]) | token.map(str.encode) | garbage
paths = st.sampled_from([route.path.encode() for route in ROUTES] + [
    b"*", b"/v1/../health", b"http://evil/livez", b"/livez?%00", b"//livez", b"/%ff"]) | garbage
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"http/1.1",
                            b"HTTP/1.1 extra", b""]) | garbage
request_lines = st.builds(lambda m, p, v: b" ".join(x for x in (m, p, v) if x),
                          methods, paths, versions) | garbage
header_lines = st.lists(st.builds(lambda n, v: n + b": " + v, st.sampled_from(
    [name.encode() for name in HEADER_NAMES] + [b"Transfer-Encoding", b"Content-Length",
                                                b"Connection", b"Host"]) | garbage,
    header_values | st.sampled_from([b"chunked", b"-1", b"0", b"99999999999999999999",
                                     b"close", b"keep-alive", b"gzip, chunked"])), max_size=6)
chunk_sizes = st.sampled_from([b"5", b"zz", b"-3", b"FFFFFFFFFFFFFFFFF", b"5;ext=1", b""])
framings = st.sampled_from(["none", "length", "short-length", "chunked", "bad-chunked"])


def frame(body: bytes, framing: str, size: bytes) -> tuple[list[bytes], bytes]:
    """Headers and payload carrying `body` the way `framing` says (some of them wrongly)."""
    if framing == "length":
        return [b"Content-Length: %d" % len(body)], body
    if framing == "short-length":  # claims less than it sends: the rest reads as a next request
        return [b"Content-Length: %d" % (len(body) // 2)], body
    if framing == "chunked":
        return [b"Transfer-Encoding: chunked"], b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    if framing == "bad-chunked":
        return [b"Transfer-Encoding: chunked"], size + b"\r\n" + body + b"\r\n"
    return [], body


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=request_lines, headers=header_lines, body=raw, framing=framings, size=chunk_sizes)
@example(line=b"GET /livez HTTP/1.1", headers=[], body=b"", framing="none", size=b"")
@example(line=b"\x16\x03\x01\x02\x00", headers=[], body=b"", framing="none", size=b"")  # TLS hello
@example(line=b"POST /v1/chat/completions HTTP/1.1", headers=[b"Content-Type: application/json"],
         body=CHAT_OK, framing="bad-chunked", size=b"zz")
def test_no_bytes_on_the_wire_make_a_5xx_or_stall_livez(
        wire: Stack, line: bytes, headers: list[bytes], body: bytes, framing: str,
        size: bytes) -> None:
    """A request line, headers and framing, each possibly garbage: every answer read back is
    below 500 (or the server hangs up), JSON refusals are in the OpenAI shape, and /livez then
    answers within LIVEZ_SINGLE_S."""
    extra, payload = frame(body, framing, size)
    host = f"Host: 127.0.0.1:{wire.target.port}".encode()
    raw_request = b"\r\n".join([line, host, *headers, *extra]) + b"\r\n\r\n" + payload
    with Conn(wire.target) as conn:
        conn.send(raw_request)
        for reply in _replies(conn, limit=3):
            assert_answer(reply.status or 0, reply.headers.get("content-type", ""), reply.body)
    _assert_livez_fast(wire)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(routes=st.lists(st.sampled_from(ROUTES), min_size=2, max_size=5))
def test_pipelined_requests_are_each_answered_in_order(wire: Stack, routes: list[Route]) -> None:
    """Requests written back to back on one connection get one answer each, in order; valid
    requests are served (200)."""
    payload = b"".join(_valid_request(wire, route) for route in routes)
    with Conn(wire.target) as conn:
        assert conn.send(payload)
        replies = [conn.reply(30) for _ in routes]
    assert [reply.status for reply in replies] == [200] * len(routes)
    for route, reply in zip(routes, replies, strict=True):
        if route.path == "/livez":
            assert json.loads(reply.body) == {"alive": True}
    _assert_livez_fast(wire)


def _valid_request(stack: Stack, route: Route) -> bytes:
    head = request_head(route.method, route.path, stack.target,
                        [("Content-Type", "application/json")] if route.valid else [],
                        content_length=len(route.valid) if route.valid else None)
    return head + route.valid


def _replies(conn: Conn, limit: int) -> Iterator[Reply]:
    """The answers the server gives, until it hangs up or goes quiet (awaiting more bytes)."""
    for _ in range(limit):
        try:
            reply = conn.reply(1.0)
        except Stalled:
            return
        if reply.hung_up:
            return
        yield reply


def _assert_livez_fast(stack: Stack, tries: int = 3) -> None:
    """The loop is not stuck: /livez answers 200 within LIVEZ_SINGLE_S at least once in
    `tries` (one slow answer on a busy shared machine is noise, three are a stall)."""
    latencies = []
    for _ in range(tries):
        started = time.perf_counter()
        response = httpx.get(f"{stack.url}/livez", timeout=10)
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200
        if latencies[-1] < LIVEZ_SINGLE_S:
            return
    raise AssertionError(f"/livez latencies {[round(x, 2) for x in latencies]}s")
