"""The worker's tokenizer and version routes: tokenize and detokenize through the gate (they
render templates and fetch media as generation does, so they take an admission slot), the
tokenizer's description and vLLM's version relayed as they are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp

from appliance.apis.api import GenerationApi
from appliance.apis.tokenizer.api import DETOKENIZE, TOKENIZE, TOKENIZER_INFO, VERSION
from appliance.engine import require_ready
from appliance.errors import ApiError, NotFound
from appliance.gate.gate import Vetted
from appliance.routes.generation import RouteDeps, generation, relay_for
from appliance.routes.handlers import get


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [
        generation("/tokenize", TOKENIZE, deps),
        generation("/detokenize", DETOKENIZE, deps),
        relayed_get(TOKENIZER_INFO, deps, _tokenizer_info_disabled),
        relayed_get(VERSION, deps),
    ]


def relayed_get(api: GenerationApi, deps: RouteDeps,
                refine: Callable[[ApiError], ApiError] | None = None) -> HTTPRouteHandler:
    """GET the worker's route as it is: no body, no slot; its refusals in the route's shape."""
    relay = deps.relay

    @get(api.path, name=api.name, opt={"shape": api.shape})
    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        require_ready(relay.engine)
        return relay_for(Vetted(api, {}, b"", method="GET", refine=refine), request, relay)

    return handle


def _tokenizer_info_disabled(error: ApiError) -> ApiError:
    if error.status != 404:
        return error
    return NotFound("GET /tokenizer_info is not enabled on this engine: vLLM serves it with "
                    "--enable-tokenizer-info-endpoint (setting engine.extra_args).",
                    code="not_enabled", reason="not_enabled")
