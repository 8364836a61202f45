"""Checks a client could make: every protocol answers, and the gate's rules answer as documented."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import httpx

from supervisor.selftest.report import Check, CheckFailed
from supervisor.selftest.target import Target

ASK = "Say hello."
ANSWER_TOKENS = 8
CLAMP_HEADER = "X-Max-Tokens-Clamped"  # as a client reads it: the documented header (docs/api.md)
# A PNG's magic bytes: a well-formed image part, which a text-only model must never receive.
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64).decode()


def _json(response: httpx.Response, path: str) -> dict[str, Any]:
    if response.status_code != 200:
        raise CheckFailed(f"{path} answered {response.status_code}: {response.text[:200]}")
    return dict(response.json())


def _streamed(target: Target, path: str, body: dict[str, Any]) -> Check:
    events = 0
    with target.client.stream("POST", path, json={"model": target.model, "stream": True} | body,
                              headers=target.headers) as response:
        if response.status_code != 200:
            raise CheckFailed(f"{path} (stream) answered {response.status_code}")
        last = ""
        for line in response.iter_lines():
            if line.startswith("data:"):
                events += 1
                last = line
    if last.strip() != "data: [DONE]":
        raise CheckFailed(f"{path} stream ended without [DONE] (last: {last[:80]!r})")
    return Check(f"{path} stream", True, f"{events} events, then [DONE]", {"events": events})


def chat(target: Target) -> Check:
    body = _json(target.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": ASK}], "max_tokens": ANSWER_TOKENS}),
        "/v1/chat/completions")
    text = body["choices"][0]["message"]["content"]
    return Check("/v1/chat/completions", True, f"answered {text!r}",
                 {"completion_tokens": body["usage"]["completion_tokens"]})


def chat_stream(target: Target) -> Check:
    return _streamed(target, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": ASK}], "max_tokens": ANSWER_TOKENS})


def completions(target: Target) -> Check:
    body = _json(target.post("/v1/completions", {"prompt": ASK, "max_tokens": ANSWER_TOKENS}),
                 "/v1/completions")
    return Check("/v1/completions", True, f"answered {body['choices'][0]['text']!r}")


def completions_stream(target: Target) -> Check:
    return _streamed(target, "/v1/completions", {"prompt": ASK, "max_tokens": ANSWER_TOKENS})


def responses(target: Target) -> Check:
    body = _json(target.post("/v1/responses", {"input": ASK, "max_output_tokens": 16}),
                 "/v1/responses")
    if body.get("object") != "response" or not body.get("output"):
        raise CheckFailed(f"/v1/responses: not a response with output: {str(body)[:200]}")
    return Check("/v1/responses", True, f"response {body['status']}, {len(body['output'])} items")


def messages(target: Target) -> Check:
    body = _json(target.post("/v1/messages", {
        "messages": [{"role": "user", "content": ASK}], "max_tokens": ANSWER_TOKENS}),
        "/v1/messages")
    if body.get("type") != "message":
        raise CheckFailed(f"/v1/messages: not a message: {str(body)[:200]}")
    return Check("/v1/messages", True, f"message, stop_reason {body.get('stop_reason')}")


def _refused(response: httpx.Response, param_prefix: str, rule: str) -> Check:
    if response.status_code != 400:
        raise CheckFailed(f"answered {response.status_code}, not 400: {response.text[:200]}")
    param = str(response.json()["error"].get("param") or "")
    if not param.startswith(param_prefix):
        raise CheckFailed(f"400 names {param!r}, not {param_prefix!r}")
    return Check(rule, True, f"400 naming {param}")


def n_cap(target: Target) -> Check:
    return _refused(target.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": ASK}], "max_tokens": 1,
        "n": target.max_n + 1}), "n", "gate: n cap")


def media_guard(target: Target) -> Check:
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]
    return _refused(target.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 1}),
        "messages[0].content[1]", "gate: media guard")


def clamp(target: Target) -> Check:
    """A budget above the window is clamped, not refused; the stream is left at its head."""
    with target.client.stream("POST", "/v1/chat/completions", json={
            "model": target.model, "stream": True, "max_tokens": 10**7,
            "messages": [{"role": "user", "content": ASK}]}) as response:
        header = response.headers.get(CLAMP_HEADER)
        if response.status_code != 200 or header is None:
            raise CheckFailed(f"answered {response.status_code} with {CLAMP_HEADER} {header!r}")
    return Check("gate: max_tokens clamp", True, f"{CLAMP_HEADER}: {header}")


CLIENT_CHECKS: list[tuple[str, Callable[[Target], Check]]] = [
    ("/v1/chat/completions", chat), ("/v1/chat/completions stream", chat_stream),
    ("/v1/completions", completions), ("/v1/completions stream", completions_stream),
    ("/v1/responses", responses), ("/v1/messages", messages),
    ("gate: n cap", n_cap), ("gate: max_tokens clamp", clamp), ("gate: media guard", media_guard),
]
