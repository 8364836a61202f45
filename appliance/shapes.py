"""How an error is written on the wire: each API family's body shape and its mid-stream ending.

A route declares its shape (route opt "shape"); everything that answers for that route, the
gate, the relay and the exception handlers, renders through it, so a client of that protocol
always gets errors its SDK can parse.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from appliance.errors import ApiError, UpstreamError

_MAX_MESSAGE = 2000  # a worker's pydantic dump can be many kilobytes; the client needs the gist


@dataclass
class StreamSoFar:
    """What a stream's ending may need to know of the stream it ends."""

    request: Mapping[str, Any]  # the body that was forwarded
    last: bytes = b""  # the last two chunks relayed, as references: no copy on the hot path
    before_last: bytes = b""

    def relayed(self, chunk: bytes) -> None:
        self.before_last, self.last = self.last, chunk


class ErrorShape(Protocol):
    """One protocol's error vocabulary."""

    name: str

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        """The JSON body of an error answer."""
        ...

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        """The SSE bytes that end a stream which cannot finish (already-sent bytes stand)."""
        ...


class OpenAIShape:
    """`{"error": {"message", "type", "param", "code"}}`; a stream ends `data: {error}` + [DONE]."""

    name = "openai"

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        detail: dict[str, Any] = {"message": error.message, "type": error.kind,
                                  "param": error.param, "code": error.code}
        if request_id is not None and error.status == 500:
            detail["request_id"] = request_id  # what an operator greps the log for
        return {"error": detail}

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        return b"data: " + msgspec.json.encode(self.body(error, None)) + b"\n\ndata: [DONE]\n\n"


_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


class ResponsesShape(OpenAIShape):
    """The Responses API: OpenAI's error body; a stream ends in its own events, `error` then the
    terminal `response.failed` (same response id as the stream's), and no [DONE]."""

    name = "responses"

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        sequence = _last_sequence(so_far) + 1
        request = so_far.request
        failed: dict[str, Any] = {
            "id": str(request.get("request_id") or ""), "object": "response",
            "created_at": int(time.time()), "model": str(request.get("model") or ""),
            "status": "failed", "output": [], "error": {"code": "server_error",
                                                         "message": error.message},
            "incomplete_details": None, "instructions": request.get("instructions"),
            "metadata": request.get("metadata"), "parallel_tool_calls": True,
            "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [],
            "background": bool(request.get("background")),
        }
        events = (
            ("error", {"type": "error", "code": error.code, "message": error.message,
                       "param": error.param, "sequence_number": sequence}),
            ("response.failed", {"type": "response.failed", "sequence_number": sequence + 1,
                                 "response": failed}),
        )
        return b"".join(_event(name, data) for name, data in events)


# Anthropic's error types, by the status the appliance answers with.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}


class AnthropicShape:
    """`{"type": "error", "error": {"type", "message"}}`; a stream ends with `event: error`."""

    name = "anthropic"

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_type(error.status),
                                                           "message": error.message}}
        if request_id is not None and error.status == 500:
            body["request_id"] = request_id
        return body

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        return _event("error", self.body(error, None))


def anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


OPENAI = OpenAIShape()
RESPONSES = ResponsesShape()
ANTHROPIC = AnthropicShape()


def encode(shape: ErrorShape, error: ApiError, request_id: str | None) -> bytes:
    return msgspec.json.encode(shape.body(error, request_id))


def upstream_error(status: int, content: bytes) -> UpstreamError:
    """The worker's error answer (any protocol's shape, or none) as an UpstreamError."""
    message, param = f"the engine answered {status}", None
    try:
        data = msgspec.json.decode(content)
    except (msgspec.DecodeError, RecursionError):
        data = None
    detail = data.get("error") if isinstance(data, dict) else None
    if isinstance(detail, dict):
        message = str(detail.get("message") or message)
        param = detail.get("param") if isinstance(detail.get("param"), str) else None
    elif isinstance(data, dict) and isinstance(data.get("detail"), str):
        message = data["detail"]  # FastAPI's own refusals
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    code = "engine_error" if status >= 500 else "invalid_request"
    return UpstreamError(status, message, param=param, code=code)


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def _last_sequence(so_far: StreamSoFar) -> int:
    """The last sequence number the client saw (-1 if none): found in the last chunks only."""
    for chunk in (so_far.last, so_far.before_last):
        found = _SEQUENCE.findall(chunk[-4096:])
        if found:
            return int(found[-1])
    return -1
