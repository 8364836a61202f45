"""Per-request context: the request id every log line and the worker carry."""

from __future__ import annotations

import re
import uuid

import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

REQUEST_ID = "x-request-id"
_REQUEST_ID = b"x-request-id"
# What a request id may be: short, and characters that survive a header, a log line and the
# engine's completion id unchanged. Anything else is replaced, never echoed.
_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def request_context(app: ASGIApp) -> ASGIApp:
    """Take the client's X-Request-Id if it is sane (else make one), put the one in force back
    in the scope's headers, and bind it into every log line of the request."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        given = [v for k, v in scope["headers"] if k == _REQUEST_ID]
        if len(given) == 1 and _VALID_ID.fullmatch(given[0]):
            request_id = given[0].decode("ascii")
        else:
            request_id = uuid.uuid4().hex
            scope["headers"] = [*(h for h in scope["headers"] if h[0] != _REQUEST_ID),
                                (_REQUEST_ID, request_id.encode("ascii"))]
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await app(scope, receive, send)

    return middleware
