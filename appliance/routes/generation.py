"""The route builder every API family uses for a route that makes the engine work: engine
ready, the JSON body read in bounded time, vetted by the gate, answered by the relay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp

from appliance.apis.api import GenerationApi
from appliance.context import REQUEST_ID
from appliance.engine import require_ready
from appliance.errors import BadRequest, RequestTimeout
from appliance.fences.uvicorn import client_link
from appliance.gate.gate import Vetted
from appliance.relay import Relay, RelayDeps
from appliance.routes.guards import client_of
from appliance.routes.handlers import post
from appliance.settings import ServerSettings

# Request headers the worker should see: tracing context, so vLLM continues the client's trace.
_FORWARDED = ("traceparent", "tracestate")

Prepare = Callable[[Vetted], None]  # a route's own step between the gate and the relay


@dataclass(frozen=True)
class RouteDeps:
    relay: RelayDeps
    server: ServerSettings


def generation(path: str, api: GenerationApi, deps: RouteDeps,
               prepare: Prepare | None = None) -> HTTPRouteHandler:
    """A generation route: engine ready, JSON body read in bounded time, vetted, relayed."""
    relay, server = deps.relay, deps.server

    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        require_ready(relay.engine)
        raw = await read_json_body(request, server.body_timeout_s)
        vetted = await relay.gate.vet(raw, api, client_of(request))
        if prepare is not None:
            prepare(vetted)
        return relay_for(vetted, request, relay)

    return post(path, name=api.name, opt={"shape": api.shape}, status_code=200)(handle)


def relay_for(vetted: Vetted, request: Request[Any, Any, Any], relay: RelayDeps) -> Relay:
    """The relay that answers this request, with the headers the worker should see."""
    forward = {name: value for name in _FORWARDED if (value := request.headers.get(name))}
    return Relay(vetted, relay, request.headers[REQUEST_ID], forward)


async def read_json_body(request: Request[Any, Any, Any], timeout_s: float) -> bytes:
    """The whole body, within `timeout_s` of the headers; JSON only, as vLLM requires."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise BadRequest("Unsupported Media Type: only 'application/json' is accepted.",
                         code="unsupported_media_type")
    link = client_link(request.scope)
    if link is not None and link.has_body():
        return await request.body()  # nothing left to wait for: no deadline to arm
    try:
        async with asyncio.timeout(timeout_s):
            return await request.body()
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s",
                             code="body_timeout") from exc
