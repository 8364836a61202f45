"""How an error is written on the wire: each API family's body shape and its mid-stream ending.

A route declares its shape (route opt "shape"); everything that answers for that route, the
gate, the relay and the exception handlers, renders through it, so a client of that protocol
always gets errors its SDK can parse.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from appliance.errors import ApiError, UpstreamError

_MAX_MESSAGE = 2000  # a worker's pydantic dump can be many kilobytes; the client needs the gist


class ErrorShape(Protocol):
    """One protocol's error vocabulary."""

    name: str

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        """The JSON body of an error answer."""
        ...

    def stream_end(self, error: ApiError) -> bytes:
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

    def stream_end(self, error: ApiError) -> bytes:
        return b"data: " + msgspec.json.encode(self.body(error, None)) + b"\n\ndata: [DONE]\n\n"


OPENAI = OpenAIShape()


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
