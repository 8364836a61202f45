"""Who may call what: declared on routers, so a route cannot forget to check."""

from __future__ import annotations

from collections.abc import Sequence

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from appliance.policy import check_bearer


def key_guard(keys: Sequence[str]) -> Guard:
    """`Authorization: Bearer <key>` must name a configured key (none configured: open)."""

    # Async on purpose: Litestar runs a sync guard on a worker thread, a thread hop per request.
    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        check_bearer(connection.headers.get("authorization"), keys)

    return guard
