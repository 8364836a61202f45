"""The OpenAI-protocol routes: generation through the gate and the relay (chat, completions,
the chat batch, SageMaker-style /invocations), and the model list; `generation(...)` builds
every route that makes the engine work, for every family."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.types import ASGIApp

from appliance import policy
from appliance.apis import BATCH_CHAT, CHAT, COMPLETION, GenerationApi
from appliance.context import REQUEST_ID
from appliance.edge import client_link
from appliance.engine import require_ready
from appliance.errors import BadRequest, NotFound, RequestTimeout, engine_unavailable
from appliance.gate import Vetted
from appliance.relay import Relay, RelayDeps
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post
from appliance.settings import ServerSettings
from appliance.upstream import Upstream

# Request headers the worker should see: tracing context, so vLLM continues the client's trace.
_FORWARDED = ("traceparent", "tracestate")

Prepare = Callable[[Vetted], None]  # a route's own step between the gate and the relay


@dataclass(frozen=True)
class RouteDeps:
    relay: RelayDeps
    server: ServerSettings


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [
        generation("/v1/chat/completions", CHAT, deps),
        generation("/v1/completions", COMPLETION, deps),
        generation("/v1/chat/completions/batch", BATCH_CHAT, deps),
        invocations(deps),
        *model_routes(deps.relay.upstream, deps.relay),
    ]


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


def invocations(deps: RouteDeps) -> HTTPRouteHandler:
    """SageMaker's /invocations: a chat body gets the chat rules, any other the completion
    rules, and goes to that route of the worker (vLLM routes it the same way, chat first)."""
    relay, server = deps.relay, deps.server

    @post("/invocations", name="invocations", status_code=200)
    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        require_ready(relay.engine)
        raw = await read_json_body(request, server.body_timeout_s)
        body = policy.parse_json(raw)
        if body.get("messages") is None and body.get("prompt") is None \
                and body.get("prompt_embeds") is None:
            raise BadRequest("An /invocations body is a chat request (with 'messages') or a "
                             "completion request (with 'prompt').", param="messages",
                             code="unknown_request_shape")
        api = CHAT if body.get("messages") is not None else COMPLETION
        return relay_for(await relay.gate.vet(raw, api, client_of(request)), request, relay)

    return handle


def relay_for(vetted: Vetted, request: Request[Any, Any, Any], relay: RelayDeps) -> Relay:
    """The relay that answers this request, with the headers the worker should see."""
    forward = {name: value for name in _FORWARDED if (value := request.headers.get(name))}
    return Relay(vetted, relay, request.headers[REQUEST_ID], forward)


def model_routes(upstream: Upstream, relay: RelayDeps) -> list[HTTPRouteHandler]:
    @get("/v1/models", name="models")
    async def models() -> Response[Any]:
        require_ready(relay.engine)
        return Response(content=await _models(upstream, relay))

    @get("/v1/models/{model:path}", name="model")
    async def model(model: FromPath[str]) -> Response[Any]:
        require_ready(relay.engine)
        wanted = model.lstrip("/")
        for entry in (await _models(upstream, relay))["data"]:
            if entry.get("id") == wanted:
                return Response(content=entry)
        raise NotFound(f"The model '{wanted}' does not exist.", param="model",
                       code="model_not_found")

    return [models, model]


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


async def _models(upstream: Upstream, relay: RelayDeps) -> dict[str, Any]:
    """The worker's model list without what the LAN need not see (the model's path on disk)."""
    status, data = await upstream.call("GET", "/v1/models")
    if status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise engine_unavailable("not answering", relay.engine.retry_after_s())
    entries = [{k: v for k, v in entry.items() if k != "root"} | {"root": entry.get("id")}
               for entry in data["data"] if isinstance(entry, dict)]
    return {"object": "list", "data": entries}
