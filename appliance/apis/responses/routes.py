"""The OpenAI Responses API: create (through the gate), retrieve and cancel (relayed), every
answer in the Responses protocol; a stored response is its own client's (ResponseIds)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Request
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath, FromQuery
from litestar.types import ASGIApp

from appliance.apis.api import WorkerRoute
from appliance.apis.responses.api import RESPONSES_CANCEL, RESPONSES_CREATE, RESPONSES_RETRIEVE
from appliance.apis.responses.response_ids import ResponseIds
from appliance.core.errors import BadRequest
from appliance.gate.gate import Vetted
from appliance.proxy.outbound import PassThrough
from appliance.proxy.request import RelayDeps
from appliance.routes.generation import RouteDeps, generation, relay_for
from appliance.routes.guards import client_of
from appliance.routes.handlers import get, post

SHAPE = {"shape": RESPONSES_CREATE.shape}


def routes(deps: RouteDeps) -> list[HTTPRouteHandler]:
    """Background responses may be streamed again only where they are allowed (vLLM breaks
    off the stream of any other stored response)."""
    relay, background = deps.relay, deps.policy.allow_background_responses
    ids = ResponseIds(relay.engine, deps.policy.max_tracked_responses)

    def prepare(vetted: Vetted, routed: RelayDeps) -> None:
        body, owner = vetted.payload, vetted.client.name
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            ids.reach(previous, owner, "previous_response_id")
        response_id, stored = body["request_id"], body.get("store") is not False
        ids.claim(response_id, owner)
        # Recorded once admitted: a refused request must not push anyone's ids out.
        vetted.admitted = lambda: ids.created(response_id, owner, stored=stored,
                                              engine=routed.engine)
        vetted.refine = lambda error: ids.explain(error, previous, "previous_response_id")

    def keeper(response_id: str) -> RelayDeps:
        """The relay of the model whose worker stored the response (reached: the id is known)."""
        engine = ids.engine_of(response_id)
        return deps.models.serving(engine).relay if engine is not None else relay

    def stored(request: Request[Any, Any, Any], route: WorkerRoute, response_id: str,
               method: str, query: str = "", payload: dict[str, Any] | None = None) -> PassThrough:
        ids.reach(response_id, client_of(request).name, "response_id")
        path = route.path.replace("{id}", quote(response_id, safe=""))
        return PassThrough(route, method, path + query, payload or {},
                           refine=lambda error: ids.explain(error, response_id, "response_id"))

    @get("/v1/responses/{response_id:str}", name=RESPONSES_RETRIEVE.name, opt=SHAPE)
    async def retrieve(request: Request[Any, Any, Any], response_id: FromPath[str],
                       stream: FromQuery[bool] = False,
                       starting_after: FromQuery[int | None] = None) -> ASGIApp:
        query = _retrieve_query(stream, starting_after, background)
        payload = {"stream": stream, "request_id": response_id}
        return relay_for(stored(request, RESPONSES_RETRIEVE, response_id, "GET", query, payload),
                         request, keeper(response_id))

    @post("/v1/responses/{response_id:str}/cancel", name=RESPONSES_CANCEL.name, opt=SHAPE,
          status_code=200)
    async def cancel(request: Request[Any, Any, Any], response_id: FromPath[str]) -> ASGIApp:
        return relay_for(stored(request, RESPONSES_CANCEL, response_id, "POST"), request,
                         keeper(response_id))

    return [generation(RESPONSES_CREATE, deps, prepare), retrieve, cancel]


def _retrieve_query(stream: bool, starting_after: int | None, background: bool) -> str:
    """The worker's query for a retrieve, checked: only what vLLM reads is passed on."""
    if stream and not background:
        raise BadRequest("Only a background response can be streamed again, and background "
                         "responses are off on this appliance (setting "
                         "policy.allow_background_responses).", param="stream",
                         code="background_not_allowed")
    if starting_after is not None and starting_after < 0:
        raise BadRequest("'starting_after' must be at least 0.", param="starting_after",
                         code="invalid_value")
    query = "?stream=true" if stream else ""
    if starting_after is not None:
        query += ("&" if query else "?") + f"starting_after={starting_after}"
    return query
