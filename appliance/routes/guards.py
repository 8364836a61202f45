"""Who may call what: declared on routers, so a route cannot forget to check."""

from __future__ import annotations

from collections.abc import Sequence

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from appliance.policy import check_bearer


def key_guard(keys: Sequence[str], *, x_api_key: bool = False) -> Guard:
    """`Authorization: Bearer <key>` must name a configured key (none configured: open).

    With `x_api_key` the router's protocol sends its key as `x-api-key: <key>` (Anthropic's
    SDK does), which is accepted as well.
    """

    # Async on purpose: Litestar runs a sync guard on a worker thread, a thread hop per request.
    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        headers = connection.headers
        check_bearer(headers.get("authorization"), keys,
                     x_api_key=headers.get("x-api-key", "") if x_api_key else None)

    return guard
