"""The OpenAI-protocol routes: generation through the gate and the relay (chat, completions,
SageMaker-style /invocations), and the model list."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.types import ASGIApp

from appliance import policy
from appliance.apis.openai.api import CHAT, COMPLETION
from appliance.core.errors import BadRequest, NotFound, engine_unavailable
from appliance.core.upstream import Upstream
from appliance.proxy.relay import RelayDeps
from appliance.routes.generation import RouteDeps, generation, read_json_body, relay_for
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [
        generation(CHAT, deps),
        generation(COMPLETION, deps),
        invocations(deps),
        *model_routes(deps.relay.upstream, deps.relay),
    ]


def invocations(deps: RouteDeps) -> HTTPRouteHandler:
    """SageMaker's /invocations: a chat body gets the chat rules, any other the completion
    rules, and goes to that route of the worker (vLLM routes it the same way, chat first)."""
    relay, server = deps.relay, deps.server

    @post("/invocations", name="invocations", status_code=200)
    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        raw = await read_json_body(request, server)
        body = policy.parse_json(raw)
        if body.get("messages") is None and body.get("prompt") is None \
                and body.get("prompt_embeds") is None:
            raise BadRequest("An /invocations body is a chat request (with 'messages') or a "
                             "completion request (with 'prompt').", param="messages",
                             code="unknown_request_shape")
        api = CHAT if body.get("messages") is not None else COMPLETION
        return relay_for(await relay.gate.vet(raw, api, client_of(request)), request, relay)

    return handle


def model_routes(upstream: Upstream, relay: RelayDeps) -> list[HTTPRouteHandler]:
    @get("/v1/models", name="models")
    async def models() -> Response[Any]:
        return Response(content=await _models(upstream, relay))

    @get("/v1/models/{model:path}", name="model")
    async def model(model: FromPath[str]) -> Response[Any]:
        wanted = model.lstrip("/")
        for entry in (await _models(upstream, relay))["data"]:
            if entry.get("id") == wanted:
                return Response(content=entry)
        raise NotFound(f"The model '{wanted}' does not exist.", param="model",
                       code="model_not_found")

    return [models, model]


async def _models(upstream: Upstream, relay: RelayDeps) -> dict[str, Any]:
    """The worker's model list without what the LAN need not see (the model's path on disk)."""
    status, data = await upstream.call("GET", "/v1/models")
    if status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise engine_unavailable("not answering", relay.engine.retry_after_s())
    entries = [{k: v for k, v in entry.items() if k != "root"} | {"root": entry.get("id")}
               for entry in data["data"] if isinstance(entry, dict)]
    return {"object": "list", "data": entries}
