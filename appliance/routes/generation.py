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
from appliance.core.context import REQUEST_ID, headers_of
from appliance.core.errors import BadRequest, RequestTimeout, body_incomplete, body_too_large
from appliance.core.sections import PolicySettings, ServerSettings
from appliance.fences.uvicorn import client_link
from appliance.gate.gate import Vetted
from appliance.proxy.outbound import Outbound, PassThrough, Refine
from appliance.proxy.relay import Relay, RelayDeps
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post
from appliance.routes.models import ServedModels

# Request headers the worker should see: tracing context, so vLLM continues the client's trace.
_FORWARDED = (b"traceparent", b"tracestate")

# A route's own step between the gate and the relay, given the relay of the model it goes to.
Prepare = Callable[[Vetted, RelayDeps], None]


@dataclass(frozen=True)
class RouteDeps:
    relay: RelayDeps  # the default model's: for what no body names a model for
    server: ServerSettings
    policy: PolicySettings
    models: ServedModels



def generation(api: GenerationApi, deps: RouteDeps,
               prepare: Prepare | None = None) -> HTTPRouteHandler:
    """POST at the API's path: JSON body read in bounded time, routed to the model it names,
    vetted by that model's gate, relayed to that model's worker."""
    server = deps.server

    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        raw = await read_json_body(request, server)
        model = deps.models.pick(raw)
        relay = model.relay
        vetted = await relay.gate.vet(raw, api, client_of(request))
        if prepare is not None:
            prepare(vetted, relay)
        return await deps.models.leased(model, vetted, relay_for(vetted, request, relay))

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
    headers = headers_of(request.scope)
    forward = {name.decode(): value.decode("latin-1") for name in _FORWARDED
               if (value := headers.get(name))}
    return Relay(outbound, relay, headers[REQUEST_ID].decode("latin-1"), forward)


async def read_json_body(request: Request[Any, Any, Any], server: ServerSettings) -> bytes:
    """The whole body, within server.body_timeout_s of the headers and at most
    server.max_body_bytes; JSON only, as vLLM requires."""
    media_type = headers_of(request.scope).get(b"content-type", b"")
    if media_type.split(b";", 1)[0].strip().lower() != b"application/json":
        raise BadRequest("Unsupported Media Type: only 'application/json' is accepted.",
                         code="unsupported_media_type")
    link = client_link(request.scope)
    if link is not None and link.has_body():
        return await _body(request, server.max_body_bytes)  # no deadline to arm: it is here
    timeout_s = server.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _body(request, server.max_body_bytes)
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s",
                             code="body_timeout") from exc


async def _body(request: Request[Any, Any, Any], max_bytes: int) -> bytes:
    """The body from ASGI's receive, as Litestar's `request.body()` reads it (its Content-Length
    and then its bytes held to `max_bytes`), without the headers multidict and async generator
    Litestar builds for it on every request."""
    declared = headers_of(request.scope).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large()  # before reading any of it
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] != "http.request":  # http.disconnect: the client went first
            raise body_incomplete()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
