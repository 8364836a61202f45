"""Per-request context: the request id (and the client's W3C trace id) every log line carries,
and the caller's client name for its log lines and metric labels."""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

REQUEST_ID = b"x-request-id"
_HEADERS = "chat-appliance.headers"  # the scope key of headers_of's mapping
# What a request id may be: short, and characters that survive a header, a log line and the
# engine's completion id unchanged. Anything else is replaced, never echoed.
_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_TRACEPARENT = b"traceparent"
# W3C Trace Context: version-traceid-parentid-flags, lower-case hex; version ff is invalid.
_VALID_TRACEPARENT = re.compile(rb"(?!ff)[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def request_context(app: ASGIApp) -> ASGIApp:
    """Take the client's X-Request-Id if it is sane (else make one), put the one in force back
    in the scope's headers, and bind it into every log line of the request, with the trace id
    of a valid `traceparent` (the worker gets the header itself and continues the trace)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        headers = scope["headers"]
        given = [v for k, v in headers if k == REQUEST_ID]
        if len(given) == 1 and _VALID_ID.fullmatch(given[0]):
            request_id = given[0].decode("ascii")
        else:
            request_id = os.urandom(16).hex()  # uuid4().hex's 32 hex digits, a fifth the cost
            kept = [h for h in headers if h[0] != REQUEST_ID] if given else list(headers)
            kept.append((REQUEST_ID, request_id.encode("ascii")))
            scope["headers"] = kept
        bound = REQUEST_ID_VAR.set(request_id)
        traced = TRACE_ID_VAR.set(_trace_id(scope["headers"]))
        try:
            await app(scope, receive, send)
        finally:
            TRACE_ID_VAR.reset(traced)
            REQUEST_ID_VAR.reset(bound)

    return middleware


def headers_of(scope: Scope) -> Mapping[bytes, bytes]:
    """The request's headers by name (lower-case, as ASGI gives them), the first of each, as
    they came; made once per request, after request_context put the request id in. Litestar's
    `request.headers` decodes every header into a multidict, the first time on each request."""
    found: Mapping[bytes, bytes] | None = scope.get(_HEADERS)  # type: ignore[assignment]
    if found is None:
        first_last = reversed(list(scope["headers"]))  # ASGI: an iterable; the first one wins
        found = scope[_HEADERS] = dict(first_last)  # type: ignore[literal-required]
    return found


def _trace_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The trace id of the one valid traceparent header, else None (several: none is trusted)."""
    given = [v for k, v in headers if k == _TRACEPARENT]
    if len(given) != 1:
        return None
    match = _VALID_TRACEPARENT.fullmatch(given[0].strip())
    if match is None or match.group(1).strip(b"0") == b"" or match.group(2).strip(b"0") == b"":
        return None  # all-zero ids are invalid by the spec
    return match.group(1).decode("ascii")


# The caller's client name for this request's metrics labels and log lines. Set by the key
# guard; "none" where no key guard ran.
NO_CLIENT = "none"  # before or without a key check
CLIENT_NAME: contextvars.ContextVar[str] = contextvars.ContextVar("client_name", default=NO_CLIENT)
# The request's id and trace id, for its log lines (request_context sets and resets them).
REQUEST_ID_VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id",
                                                                        default=None)
TRACE_ID_VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)


def bind_client(name: str) -> None:
    """Name the request's client in every later log line and metric label of the request."""
    CLIENT_NAME.set(name)


def add_request_fields(_: object, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: the request's id, trace id and client into each of its log lines
    (a field the line names itself is kept). Three reads of this module's context variables:
    structlog's merge_contextvars copies the whole context and walks each variable in it, and
    its bind_contextvars makes a token per field, on every request."""
    request_id = REQUEST_ID_VAR.get()
    if request_id is not None:
        event.setdefault("request_id", request_id)
        trace_id = TRACE_ID_VAR.get()
        if trace_id is not None:
            event.setdefault("trace_id", trace_id)
    client = CLIENT_NAME.get()
    if client != NO_CLIENT:
        event.setdefault("client", client)
    return event
