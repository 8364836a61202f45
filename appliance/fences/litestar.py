"""The fence around Litestar's internals: the one module that leans on what Litestar does not promise.

What it relies on (tests/unit/fences/test_litestar.py checks each against the installed Litestar):
- `HTTPRouteHandler.authorize_connection(connection)` is what Litestar's routes call to run a
  handler's guards, and its whole body is "each of `resolve_guards()`, awaited with
  (connection, copy(handler))". The copy is made on every request for every guard: a handler
  has some sixty attributes, and the copy was 5 % of a small request's CPU. No guard of ours
  changes the handler it is given, so `Handler` passes the handler itself.
- Litestar's router puts the matched handler and its path template (without the parameters'
  types: `/v1/models/{model}`) in the ASGI scope as `route_handler` and `path_template`;
  `handler_of` and `route_of` read them.
- A request body whose connection ends first (a body shorter than its Content-Length, a chunk
  uvicorn could not parse, a hang-up) makes Litestar raise a 500, InternalServerException with
  the detail "client disconnected prematurely"; `client_left` recognises it.
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import InternalServerException
from litestar.handlers import HTTPRouteHandler
from litestar.types import Scope

_CLIENT_LEFT = "client disconnected prematurely"


class Handler(HTTPRouteHandler):
    """Litestar's HTTP route handler, whose guards are given the handler itself, not a copy."""

    async def authorize_connection(self, connection: ASGIConnection[Any, Any, Any, Any]) -> None:
        for guard in self.resolve_guards():
            await guard(connection, self)  # type: ignore[misc]


def handler_of(scope: Scope) -> HTTPRouteHandler | None:
    """The route handler Litestar matched for this request (None before routing, or none)."""
    handler = scope.get("route_handler")
    return handler if isinstance(handler, HTTPRouteHandler) else None


def route_of(scope: Scope) -> str | None:
    """The matched route's path template (`/v1/models/{model}`), None if none matched."""
    template = scope.get("path_template")
    return template if isinstance(template, str) else None


def client_left(exc: BaseException) -> bool:
    """Whether Litestar raised `exc` because the client's connection ended before the request's
    body did: the client's doing, not a fault of ours."""
    return isinstance(exc, InternalServerException) and exc.detail == _CLIENT_LEFT
