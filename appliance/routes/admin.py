"""The operator's route: reload the clients table (key rotation) without a restart.

`chat-appliance reload` calls it. It takes no key (the keys are what is being replaced) and
answers only a caller on this machine, never one a proxy relays.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from litestar import Response
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler

from appliance.admission.clients import Roster
from appliance.errors import BadRequest, Forbidden
from appliance.routes.handlers import post
from appliance.settings import ConfigError, Settings, load_settings

RELOAD_PATH = "/admin/reload"
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def routes(clients: Roster,
           load: Callable[[], Settings] = load_settings) -> list[HTTPRouteHandler]:

    @post(RELOAD_PATH, guards=[local_only], status_code=200, sync_to_thread=False)
    def reload() -> Response[dict[str, Any]]:
        try:
            table = clients.reload(load)
        except ConfigError as exc:
            raise BadRequest(f"configuration not reloaded, the clients in force stay: {exc}",
                             code="bad_configuration", reason="bad_configuration") from exc
        return Response(content={"reloaded": True, "clients": table.names, "keys": table.keys,
                                 "generation": clients.generation})

    return [reload]


def local_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
    """The peer is this machine (loopback, or the very address the API answers on)."""
    peer = (connection.scope.get("client") or ("", 0))[0]
    server = (connection.scope.get("server") or ("", 0))[0]
    relayed = any(name in connection.headers for name in _PROXY_HEADERS)
    if relayed or not (_loopback(peer) or (peer and peer == server)):
        raise Forbidden("this route answers callers on the appliance's own machine only",
                        code="local_only", reason="local_only")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
