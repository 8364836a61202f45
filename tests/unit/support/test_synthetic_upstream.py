"""The synthetic worker writes what vLLM 0.32 writes: its streams have the recorded streams'
events, in their order, each with the same fields in the same order and of the same kinds."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from load.kit.synthetic_worker import SyntheticWorker

pytestmark = pytest.mark.anyio
UNIT = Path(__file__).resolve().parents[1]
RECORDED = {  # vLLM 0.32 (CPU, SmolLM2), with the request that made each
    "chat_plain": (UNIT / "appliance/admission/recorded/chat_plain.sse",
                   "/v1/chat/completions", {"max_tokens": 3}),
    "chat_usage": (UNIT / "appliance/admission/recorded/chat_usage.sse",
                   "/v1/chat/completions",
                   {"max_tokens": 3, "stream_options": {"include_usage": True}}),
    "completion_plain": (UNIT / "appliance/admission/recorded/completion_plain.sse",
                         "/v1/completions", {"max_tokens": 3}),
    "completion_usage": (UNIT / "appliance/admission/recorded/completion_usage.sse",
                         "/v1/completions",
                         {"max_tokens": 3, "stream_options": {"include_usage": True}}),
    "responses": (UNIT / "appliance/apis/vllm_responses_stream.sse", "/v1/responses",
                  {"max_output_tokens": 40, "temperature": 0}),
    "messages": (UNIT / "appliance/apis/vllm_messages_stream.sse", "/v1/messages",
                 {"max_tokens": 40}),
}
# Fields whose value is part of the shape: what a client or the appliance branches on.
LITERAL = {"object", "type", "role", "finish_reason", "stop_reason", "status", "reason"}


def shape(value: Any, key: str = "") -> Any:
    """A JSON value with its data left out: objects keep their keys in order, lists their
    distinct item shapes, scalars their kind (LITERAL fields their value)."""
    if isinstance(value, dict):
        return tuple((k, shape(v, k)) for k, v in value.items())
    if isinstance(value, list):
        return ("list", *dict.fromkeys(shape(item) for item in value))
    if key in LITERAL and value is not None:
        return value
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, int | float) else type(value).__name__


def stream_shape(body: bytes) -> list[Any]:
    """Each SSE event's name and data shape, runs of like events as one (the token events)."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = lines["data"]
        events.append((lines.get("event"), data if data == "[DONE]" else shape(json.loads(data))))
    return [event for event, _ in itertools.groupby(events)]


async def synthetic(path: str, body: dict[str, Any]) -> httpx.Response:
    worker = SyntheticWorker(64, 0.0, "synthetic")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=worker),
                                 base_url="http://worker") as client:
        return await client.post(path, json=body)


def request_for(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    said = ({"messages": [{"role": "user", "content": "hi"}]} if "messages" in path
            or "chat" in path else {"input": "hi"} if "responses" in path else {"prompt": "hi"})
    return {"model": "synthetic", "stream": True, **said, **extra}


@pytest.mark.parametrize("name", sorted(RECORDED))
async def test_its_stream_has_the_recorded_vllm_streams_shape(name: str) -> None:
    recorded, path, extra = RECORDED[name]
    response = await synthetic(path, request_for(path, extra))
    assert response.status_code == 200
    assert stream_shape(response.content) == stream_shape(recorded.read_bytes())


@pytest.mark.parametrize(("path", "kind"), [("/v1/chat/completions", "chat.completion"),
                                            ("/v1/completions", "text_completion")])
async def test_its_answers_are_typed_as_vllms(path: str, kind: str) -> None:
    response = await synthetic(path, request_for(path, {"stream": False, "max_tokens": 3}))
    assert response.json()["object"] == kind


async def test_tokenize_gives_the_tokens_it_counts_in_vllms_fields() -> None:
    """vLLM's TokenizeResponse (vllm/entrypoints/serve/tokenize/protocol.py)."""
    answer = (await synthetic("/tokenize", {"model": "synthetic", "prompt": "x" * 40})).json()
    assert list(answer) == ["count", "max_model_len", "tokens", "token_strs"]
    assert answer["count"] == len(answer["tokens"]) == 10
    assert all(isinstance(token, int) for token in answer["tokens"])
