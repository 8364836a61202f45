"""The route builders every API family uses: a route that makes the engine work (the JSON body
read in bounded time, vetted by the gate, answered by the relay) and one passed through to the
worker as it is. That the engine is ready is declared on the routers (guards.ready_guard)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp

from appliance.apis.api import GenerationApi, WorkerRoute
from appliance.context import REQUEST_ID
from appliance.errors import BadRequest, RequestTimeout
from appliance.fences.uvicorn import client_link
from appliance.gate.gate import Vetted
from appliance.outbound import Outbound, PassThrough, Refine
from appliance.relay import Relay, RelayDeps
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post
from appliance.settings import PolicySettings, ServerSettings

# Request headers the worker should see: tracing context, so vLLM continues the client's trace.
_FORWARDED = ("traceparent", "tracestate")

Prepare = Callable[[Vetted], None]  # a route's own step between the gate and the relay


@dataclass(frozen=True)
class RouteDeps:
    relay: RelayDeps
    server: ServerSettings
    policy: PolicySettings


def generation(api: GenerationApi, deps: RouteDeps,
               prepare: Prepare | None = None) -> HTTPRouteHandler:
    """POST at the API's path: JSON body read in bounded time, vetted, relayed."""
    relay, server = deps.relay, deps.server

    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        raw = await read_json_body(request, server.body_timeout_s)
        vetted = await relay.gate.vet(raw, api, client_of(request))
        if prepare is not None:
            prepare(vetted)
        return relay_for(vetted, request, relay)

    return post(api.path, name=api.name, opt={"shape": api.shape}, status_code=200)(handle)


def passed_through(route: WorkerRoute, deps: RouteDeps,
                   refine: Refine | None = None) -> HTTPRouteHandler:
    """GET the worker's route as it is: no body, no slot; its refusals in the route's shape."""
    relay = deps.relay

    @get(route.path, name=route.name, opt={"shape": route.shape})
    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        return relay_for(PassThrough(route, "GET", route.path, refine=refine), request, relay)

    return handle


def relay_for(outbound: Outbound, request: Request[Any, Any, Any], relay: RelayDeps) -> Relay:
    """The relay that answers this request, with the headers the worker should see."""
    forward = {name: value for name in _FORWARDED if (value := request.headers.get(name))}
    return Relay(outbound, relay, request.headers[REQUEST_ID], forward)


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
