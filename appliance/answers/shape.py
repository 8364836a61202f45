"""How an error is written on the wire: the shape every API family gives its errors.

Each family's own shape lives in its folder (appliance/apis/<family>/). A route declares its
shape (route opt "shape"); everything that answers for that route, the gate, the relay and the
exception handlers, renders through it, so a client of that protocol always gets errors its SDK
can parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from appliance.core.errors import ApiError, UpstreamError

_MAX_MESSAGE = 2000  # a worker's pydantic dump can be many kilobytes; the client needs the gist


@dataclass(frozen=True)
class StreamSoFar:
    """What a stream's ending may need to know of the stream it ends."""

    request: Mapping[str, Any]  # the body that was forwarded
    last: bytes = b""  # the last two chunks relayed (the relay keeps them as it goes)
    before_last: bytes = b""


class ErrorShape(Protocol):
    """One protocol's error vocabulary."""

    name: str

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        """The JSON body of an error answer."""
        ...

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        """The SSE bytes that end a stream which cannot finish (already-sent bytes stand)."""
        ...


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


def sse_event(name: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
