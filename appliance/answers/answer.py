"""Every error answer the appliance writes, with its one log line and its one metric.

Three places answer errors, each on its own wire: the exception handler (a Litestar Response),
the relay (ASGI messages; once the head went, the protocol's stream ending) and the connection
edge (raw HTTP/1.1, before any route ran). Each calls `error_answer` here, which logs the error
once, counts it once on the caller's tally, and renders it in the route's error shape.

The log line says what happened: `request.unhandled_exception` (a bug, with its traceback),
`request.failed` (the engine failed the request, or a stream could not finish), else
`request.rejected` (a refusal, 503 while the engine is unavailable included: nothing was done).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

import structlog
from litestar.types import Send

from appliance.answers.shape import ErrorShape, StreamSoFar, encode
from appliance.core.errors import ApiError, ServiceUnavailable

log = structlog.get_logger("appliance.core.errors")

_JSON = (b"content-type", b"application/json")


class ErrorTally(Protocol):
    """Where the caller counts the errors it answers."""

    def error_answered(self, error: ApiError, route: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """An error as a whole answer: status, headers (Retry-After, X-Request-Id...), JSON body."""

    status: int
    headers: dict[str, str]  # besides content-type, which is JSON
    body: bytes

    async def send(self, send: Send) -> None:
        """As the ASGI answer."""
        headers = [_JSON, *((k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in self.headers.items())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})

    def http1(self) -> bytes:
        """As raw HTTP/1.1 on a connection closed after it (the edge's answers)."""
        lines = [f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}",
                 "content-type: application/json", f"content-length: {len(self.body)}",
                 *(f"{k.lower()}: {v}" for k, v in self.headers.items()
                   if k.lower() != "connection"), "connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def error_answer(error: ApiError, shape: ErrorShape, request_id: str | None, tally: ErrorTally,
                 *, route: str = "other", **fields: Any) -> ErrorAnswer:
    """Log and count the error once; render it as the whole answer in the route's shape."""
    _report(error, tally, route, False, fields)
    headers = error.headers()
    if request_id is not None:
        headers["x-request-id"] = request_id
    return ErrorAnswer(error.status, headers, encode(shape, error, request_id))


def stream_error_end(error: ApiError, shape: ErrorShape, so_far: StreamSoFar, tally: ErrorTally,
                     *, route: str) -> bytes:
    """Log and count the error once; render it as the end of a stream whose head already went
    (its status stands): the protocol's own closing events."""
    _report(error, tally, route, True, {})
    return shape.stream_end(error, so_far)


def _report(error: ApiError, tally: ErrorTally, route: str, streaming: bool,
            fields: dict[str, Any]) -> None:
    tally.error_answered(error, route)
    if error.bug is not None:
        log.error("request.unhandled_exception", route=route, error=type(error.bug).__name__,
                  exc_info=error.bug, **fields)
    elif streaming or (error.status >= 500 and not isinstance(error, ServiceUnavailable)):
        log.warning("request.failed", status=error.status, code=error.code,
                    detail=error.message[:200], streaming=streaming, **fields)
    else:
        log.info("request.rejected", status=error.status, code=error.code, param=error.param,
                 reason=error.reason, **fields)
