"""The Anthropic Messages API: messages and count_tokens through the gate, every answer (the
gate's own refusals included) in Anthropic's error shape, so its SDK raises its typed errors."""

from __future__ import annotations

from litestar.handlers import HTTPRouteHandler

from appliance.apis.anthropic.api import COUNT_TOKENS, MESSAGES
from appliance.routes.generation import RouteDeps, generation


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    """Served under a router whose key guard also accepts `x-api-key` (Anthropic's header)."""
    return [
        generation(MESSAGES, deps),
        generation(COUNT_TOKENS, deps),
    ]
