"""The route decorators every family uses: Litestar's, with guards given the handler itself.

Litestar hands each guard a fresh shallow copy of the route handler, made on every request
(`copy(self)` in `authorize_connection`): a handler has some sixty attributes, and the copy
was 5 % of a small request's CPU. No guard of ours changes the handler it is given, so the
handler itself is passed. Use `get` and `post` from here, not from litestar.
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.enums import HttpMethod
from litestar.handlers import HTTPRouteHandler


class Handler(HTTPRouteHandler):
    async def authorize_connection(self, connection: ASGIConnection[Any, Any, Any, Any]) -> None:
        for guard in self.resolve_guards():
            await guard(connection, self)  # type: ignore[misc]


def get(path: str, **kwargs: Any) -> Handler:
    return Handler(path, http_method=HttpMethod.GET, **kwargs)


def post(path: str, **kwargs: Any) -> Handler:
    return Handler(path, http_method=HttpMethod.POST, **kwargs)
