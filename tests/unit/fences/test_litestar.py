"""The Litestar fence's contract: what appliance/fences/litestar.py assumes of the installed Litestar."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from litestar import Litestar, Request, post
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath
from litestar.testing import TestClient

from appliance.fences.litestar import Handler, client_left, handler_of, route_of
from appliance.routes.handlers import get
from tests.unit.fences.contract import Fence

LITESTAR = Fence("appliance/fences/litestar.py", "litestar")


def test_authorize_connection_is_the_method_handler_replaces_and_does_what_it_did() -> None:
    """Handler overrides it: a Litestar that checks more there would have it skipped."""
    original = LITESTAR.attribute(HTTPRouteHandler, "authorize_connection")
    LITESTAR.require(inspect.iscoroutinefunction(original),
                     "HTTPRouteHandler.authorize_connection is a coroutine function")
    LITESTAR.parameters(original, ["self", "connection"])
    LITESTAR.body(original, "for guard in self.resolve_guards():\n"
                            "    await guard(connection, copy(self))")
    LITESTAR.parameters(Handler.authorize_connection, ["self", "connection"])
    LITESTAR.attribute(HTTPRouteHandler, "resolve_guards")


def test_litestar_runs_guards_through_the_fence_with_the_handler_itself() -> None:
    """A real request: Litestar's route calls Handler.authorize_connection (the guard is given
    the very handler), and the scope carries the matched handler and path template."""
    seen: list[tuple[object, object, str | None]] = []

    def guard(connection: ASGIConnection[Any, Any, Any, Any], given: BaseRouteHandler) -> None:
        seen.append((given, handler_of(connection.scope), route_of(connection.scope)))

    @get("/items/{item:int}", guards=[guard], sync_to_thread=False)
    def item(item: FromPath[int]) -> dict[str, int]:
        return {"item": item}

    with TestClient(Litestar(route_handlers=[item])) as client:
        assert client.get("/items/7").json() == {"item": 7}
    LITESTAR.require(len(seen) == 1, "a route's guards run once per request", len(seen))
    given, matched, template = seen[0]
    LITESTAR.require(isinstance(matched, Handler) and matched.paths == item.paths,
                     "the router puts the handler in scope['route_handler']", matched)
    LITESTAR.require(given is matched, "the route calls authorize_connection, so the guard gets "
                     "the handler itself, not a copy", given)
    LITESTAR.require(template == "/items/{item}",
                     "the router puts the path template in scope['path_template']", template)


def test_a_body_cut_short_by_its_client_is_an_exception_client_left_recognises() -> None:
    """The connection ends mid-body (uvicorn's receive says http.disconnect): the exception
    Litestar raises from `request.body()` is the one the fence tells apart from a bug."""
    raised: list[BaseException] = []

    @post("/echo")
    async def echo(request: Request[Any, Any, Any]) -> None:
        try:
            await request.body()
        except Exception as exc:
            raised.append(exc)
            raise

    messages = iter([{"type": "http.request", "body": b'{"a"', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> Any:
        return next(messages)

    async def send(_: Any) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo",
             "query_string": b"", "root_path": "", "headers": [(b"content-length", b"100")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "asgi": {"version": "3.0"}, "state": {}}
    asyncio.run(Litestar(route_handlers=[echo], debug=False)(scope, receive, send))
    LITESTAR.require(len(raised) == 1 and client_left(raised[0]),
                     "request.body() raises InternalServerException('client disconnected "
                     "prematurely') when the client's connection ends mid-body", raised)
    LITESTAR.require(not client_left(RuntimeError("client disconnected prematurely")),
                     "client_left() recognises Litestar's exception, not any with that text")


def test_litestar_has_an_upper_bound_the_installed_version_is_within() -> None:
    LITESTAR.bounded()
