"""Who may call what, and when: declared on routers, so a route cannot forget to check."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard, Scope

from appliance.admission.clients import ANYONE, Client, Roster
from appliance.core.context import bind_client, headers_of
from appliance.core.errors import Forbidden, Unauthorized, engine_unavailable
from appliance.routes.models import ServedModels

_CLIENT = "appliance.client"  # where the guard leaves the client in the request's scope state


def key_guard(clients: Roster, *, x_api_key: bool = False) -> Guard:
    """`Authorization: Bearer <key>` must name a configured key (none configured: open, as the
    anonymous client); the client it names must be allowed the route.

    With `x_api_key` the router's protocol sends its key as `x-api-key: <key>` (Anthropic's
    SDK does), which is accepted as well.
    """

    # Async on purpose: Litestar runs a sync guard on a worker thread, a thread hop per request.
    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        headers = headers_of(connection.scope)
        client = clients.identify(_text(headers.get(b"authorization")),
                                  _text(headers.get(b"x-api-key", b"")) if x_api_key else None)
        bind_client(client.name)
        connection.scope.setdefault("state", {})[_CLIENT] = client
        route = str(connection.scope.get("path_template") or connection.scope["path"])
        if not client.may_use(route):
            raise Forbidden(f"client '{client.name}' may not use {route}",
                            code="route_not_allowed", reason="route_not_allowed")

    return guard


def holds_key(clients: Roster, scope: Scope, route: str) -> bool:
    """Whether the request's `Authorization` names a client allowed `route`: for a route that
    answers a caller without one less, instead of nothing."""
    try:
        client = clients.identify(_text(headers_of(scope).get(b"authorization")))
    except Unauthorized:
        return False
    return client.may_use(route)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def client_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Client:
    """The client the key guard identified (anonymous where no guard ran)."""
    state = connection.scope.get("state") or {}
    client = state.get(_CLIENT, ANYONE)
    return client if isinstance(client, Client) else ANYONE


def ready_guard(models: ServedModels) -> Guard:
    """503 with Retry-After, before any work is done for a request, unless an engine serves;
    in the route's error shape, as every refusal of a guard is. Which model's engine a request
    needs is known once its body is read (ServedModels.pick); with one model, it is this one."""

    async def guard(_: ASGIConnection, __: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        if not models.any_ready():
            engine = models.default.engine
            raise engine_unavailable(engine.state.value, engine.retry_after_s())

    return guard
