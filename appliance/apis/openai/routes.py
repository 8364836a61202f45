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
from appliance.core.errors import ApiError, BadRequest, NotFound, engine_unavailable
from appliance.routes.generation import RouteDeps, generation, read_json_body, relay_for
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post
from appliance.routes.models import ServedModel, ServedModels


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    return [
        generation(CHAT, deps),
        generation(COMPLETION, deps),
        invocations(deps),
        *model_routes(deps.models),
    ]


def invocations(deps: RouteDeps) -> HTTPRouteHandler:
    """SageMaker's /invocations: a chat body gets the chat rules, any other the completion
    rules, and goes to that route of the worker (vLLM routes it the same way, chat first)."""
    server = deps.server

    @post("/invocations", name="invocations", status_code=200)
    async def handle(request: Request[Any, Any, Any]) -> ASGIApp:
        raw = await read_json_body(request, server)
        model = deps.models.pick(raw)
        relay = model.relay
        body = policy.parse_json(raw)
        if body.get("messages") is None and body.get("prompt") is None \
                and body.get("prompt_embeds") is None:
            raise BadRequest("An /invocations body is a chat request (with 'messages') or a "
                             "completion request (with 'prompt').", param="messages",
                             code="unknown_request_shape")
        api = CHAT if body.get("messages") is not None else COMPLETION
        vetted = await relay.gate.vet(raw, api, client_of(request))
        return await deps.models.leased(model, vetted, relay_for(vetted, request, relay))

    return handle


def model_routes(models: ServedModels) -> list[HTTPRouteHandler]:
    @get("/v1/models", name="models")
    async def listed() -> Response[Any]:
        return Response(content=await _models(models))

    @get("/v1/models/{model:path}", name="model")
    async def model(model: FromPath[str]) -> Response[Any]:
        wanted = model.lstrip("/")
        for entry in (await _models(models))["data"]:
            if entry.get("id") == wanted:
                return Response(content=entry)
        raise NotFound(f"The model '{wanted}' does not exist.", param="model",
                       code="model_not_found")

    return [listed, model]


async def _models(models: ServedModels) -> dict[str, Any]:
    """Every model of the catalog with its state: a ready worker's own entries (its window,
    without the model's path on disk, which the LAN need not see); a model whose worker is not
    ready (or does not answer), its names from the catalog. 503 while no worker answers, unless
    residency unloaded them (a request loads one)."""
    entries: list[dict[str, Any]] = []
    answered = False
    for served in models:
        listed = await _worker_models(served) if served.ready else None
        answered |= listed is not None
        state = served.engine.state.value
        entries += [entry | {"state": state} for entry in listed] if listed is not None else [
            {"id": name, "object": "model", "owned_by": "chat-appliance", "root": served.name,
             "state": state} for name in served.entry.served_names]
    if not answered and models.residency is None:  # with residency, none loaded is no fault
        engine = models.default.engine
        raise engine_unavailable("not answering", engine.retry_after_s())
    return {"object": "list", "data": entries}


async def _worker_models(served: ServedModel) -> list[dict[str, Any]] | None:
    try:
        status, data = await served.relay.upstream.call("GET", "/v1/models")
    except ApiError:  # the worker did not answer: listed from the catalog
        return None
    if status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    return [{k: v for k, v in entry.items() if k != "root"} | {"root": entry.get("id")}
            for entry in data["data"] if isinstance(entry, dict)]
