"""The API's front door, all the supervisor builds it from: the state it keeps across requests,
the Litestar application (route families under their guards, one error rendering), and the server
that puts it on the LAN behind the edge's limits."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, Router
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Receive, Scope, Send
from prometheus_client import CollectorRegistry

from appliance.admission.clients import Roster
from appliance.admission.slots import Admission
from appliance.answers.answer import ErrorAnswer, error_answer
from appliance.answers.shape import ErrorShape
from appliance.apis.anthropic import routes as anthropic
from appliance.apis.batch import routes as batch
from appliance.apis.openai import routes as openai
from appliance.apis.openai.api import OPENAI
from appliance.apis.responses import routes as responses
from appliance.apis.tokenizer import routes as tokenizer
from appliance.core.catalog import Catalog, CatalogEntry
from appliance.core.context import REQUEST_ID, headers_of, request_context
from appliance.core.engine import EngineView, Residency
from appliance.core.errors import (
    ApiError,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    body_incomplete,
    body_too_large,
    internal_error,
)
from appliance.core.settings import Settings
from appliance.core.upstream import Limits, Upstream
from appliance.edge.hosts import AllowedHosts, misdirected
from appliance.edge.limits import EdgeMetrics, edge_protocol
from appliance.fences.litestar import client_left, route_of
from appliance.fences.uvicorn import ApiServer, listener
from appliance.gate.budget import BudgetFitter
from appliance.gate.gate import Gate
from appliance.observe.metrics import UNROUTED, RequestMetrics
from appliance.policy.cost_watch import CostWatch
from appliance.proxy.relay import RelayDeps
from appliance.recovery.quarantine import Quarantine
from appliance.routes import guards, ops
from appliance.routes.generation import RouteDeps
from appliance.routes.models import ServedModel, ServedModels
from appliance.status import routes as status
from appliance.status.document import StatusSources
from appliance.status.recent import EngineReading, Recent


@dataclass(frozen=True)
class ApiState:
    """What the API keeps across requests that the supervisor also acts on: the admission it
    drains at a stop, the clients table a reload replaces, the quarantine its forensics tell of
    each engine death."""

    admission: Admission
    clients: Roster
    quarantine: Quarantine

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiState:
        return cls(Admission.from_settings(settings), Roster.from_settings(settings),
                   Quarantine(settings.resume))


def api_server(settings: Settings, app: Litestar, registry: CollectorRegistry,
               tls: Callable[[], ssl.SSLContext] | None) -> ApiServer:
    """The app on the LAN. With a certificate the port speaks TLS only, with the context `tls`
    gives at each handshake (a reload re-reads it in place); the listener does the TLS (uvicorn
    gets no ssl) so that the handshake is bounded and counted against the connection cap."""
    server = settings.server
    protocol = listener(edge_protocol(server, EdgeMetrics(registry)), tls,
                        server.tls_handshake_timeout_s)
    return ApiServer(uvicorn.Config(app, host=server.host, port=server.port,
                                    http=protocol, log_config=None, access_log=False,
                                    lifespan="on", timeout_keep_alive=server.idle_timeout_s,
                                    timeout_graceful_shutdown=server.close_timeout_s,
                                    proxy_headers=False,  # X-Forwarded-* from the LAN is not trusted
                                    server_header=False))


def create_app(
    settings: Settings,
    engine: EngineView,
    *,
    registry: CollectorRegistry | None = None,
    admission: Admission | None = None,
    clients: Roster | None = None,
    alive: Callable[[], bool] = lambda: True,
    engine_reading: EngineReading = lambda: None,
    quarantine: Quarantine | None = None,
    models: Mapping[str, EngineView] | None = None,
    residency: Residency | None = None,
) -> Litestar:
    """Build the API around an engine view; nothing here reaches into the supervisor.

    `engine` is the default model's; `models` has each model of the catalog's by its name (the
    default's included; without a catalog the one model is `engine`). `engine_reading` gives the default
    worker's own counters as the supervisor last read them (the status page's tokens/s and
    engine queue); without it those read as unknown. `quarantine` is told of engine deaths by
    the supervisor's crash forensics; without it none is counted. `residency` loads and unloads
    models on demand (None: every model stays loaded)."""
    # Client names only where /metrics asks for a key.
    metrics = RequestMetrics(registry or CollectorRegistry(),
                             client_names=settings.server.protect_ops_routes)
    admission = admission or Admission.from_settings(settings)
    metrics.in_flight.set_function(lambda: admission.in_flight)
    metrics.queued.set_function(lambda: admission.queued)
    clients = clients or Roster.from_settings(settings)
    quarantine = quarantine or Quarantine(settings.resume)
    quarantine.listeners.append(metrics.quarantined)
    catalog = Catalog.from_settings(settings)
    engines = dict(models) if models is not None and settings.models else {
        catalog.default.name: engine}

    def served(entry: CatalogEntry) -> ServedModel:
        """A model's own relay: its worker's address, its gate (its window, its modalities),
        its admission cap in front of the box's."""
        view, own = engines[entry.name], entry.settings(settings)
        upstream = Upstream(view.base_url, Limits.of(settings.server), view.retry_after_s)
        gate = Gate(own, BudgetFitter(upstream, view, settings.policy), metrics.clamped)
        slots = admission.for_model(entry.name, entry.max_inflight)
        return ServedModel(entry, RelayDeps(view, slots, gate, upstream, metrics,
                                            settings.resume, quarantine,
                                            CostWatch(settings.constraints, metrics.too_costly)))

    served_models = ServedModels([served(entry) for entry in catalog],
                                 routed=bool(settings.models), residency=residency)
    recent = Recent(settings.status, metrics, lambda: admission.in_flight, engine_reading)
    sources = StatusSources(settings, engine, admission, metrics, recent, engine_reading,
                            quarantine, served_models)
    protect = settings.server.protect_ops_routes
    operations = Router("/", route_handlers=[*ops.guarded_routes(metrics),
                                             *status.data_routes(sources)],
                        guards=[guards.key_guard(clients)] if protect else [])
    health = ops.health_route(served_models, admission, (lambda scope: guards.holds_key(
        clients, scope, "/health")) if protect else (lambda _: True))

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        sampler = asyncio.create_task(recent.run())
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            for model in served_models:
                await model.relay.upstream.aclose()

    def answer(scope: Scope, error: ApiError) -> ErrorAnswer:
        request_id = headers_of(scope).get(REQUEST_ID)
        return error_answer(error, _shape(scope),
                            None if request_id is None else request_id.decode("latin-1"),
                            metrics, route=route_of(scope) or UNROUTED)

    hosts = AllowedHosts(settings.server)

    def on_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        # Where no route matched (404, 405) the host check has not run yet.
        host = headers_of(request.scope).get(b"host")
        error = _as_api_error(exc) if hosts.allows(host) else misdirected(host)
        answered = answer(request.scope, error)
        return Response(content=answered.body, status_code=answered.status,
                        media_type="application/json", headers=answered.headers)

    return Litestar(
        route_handlers=[*_api_routers(settings, served_models, clients), operations,
                        *ops.open_routes(alive, served_models), health, *status.page_routes()],
        exception_handlers={Exception: on_error},
        # The Host before any route's guards, body or handler: a page that rebound a name to
        # this box gets nothing from any route (request_context and metrics only note it).
        middleware=[request_context, metrics.middleware, host_check(hosts, answer)],
        lifespan=[lifespan],
        request_max_body_size=settings.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,  # the supervisor configures logging once, for the whole process
        debug=False,
    )


def _api_routers(settings: Settings, models: ServedModels, clients: Roster) -> list[Router]:
    """The API families' routes, each behind the key guard its protocol's clients expect, and
    answered only while an engine serves. A new family is one line here."""
    deps = RouteDeps(models.default.relay, settings.server, settings.policy, models)
    ready = guards.ready_guard(models)
    api = Router("/", route_handlers=[*openai.routes(deps), *batch.routes(deps),
                                      *responses.routes(deps), *tokenizer.routes(deps)],
                 guards=[guards.key_guard(clients), ready])
    # Anthropic's SDK sends its key as x-api-key: accepted on its routes, as Bearer is.
    anthropic_api = Router("/", route_handlers=anthropic.routes(deps),
                           guards=[guards.key_guard(clients, x_api_key=True), ready])
    return [api, anthropic_api]


def _shape(scope: Scope) -> ErrorShape:
    handler = scope.get("route_handler")
    shape = handler.opt.get("shape") if handler is not None else None
    return shape if shape is not None else OPENAI


def host_check(hosts: AllowedHosts,
               answer: Callable[[Scope, ApiError], ErrorAnswer]) -> Callable[[ASGIApp], ASGIApp]:
    """A Host this appliance does not answer is refused before the route's guards, its body
    or its handler run (appliance.edge.hosts)."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def checked(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == ScopeType.HTTP:
                host = headers_of(scope).get(b"host")
                if not hosts.allows(host):
                    await answer(scope, misdirected(host)).send(send)
                    return
            await app(scope, receive, send)

        return checked

    return middleware


def _as_api_error(exc: Exception) -> ApiError:
    """Our errors as they are; Litestar's own refusals in our vocabulary; anything else a bug."""
    if isinstance(exc, ApiError):
        return exc
    if client_left(exc):  # a body cut short (read by Litestar)
        return body_incomplete()
    if isinstance(exc, HTTPException):
        status = exc.status_code
        if status == 404:
            return NotFound("no such route", code="not_found", reason="not_found")
        if status == 405:
            return MethodNotAllowed("method not allowed on this route", code="method_not_allowed",
                                    reason="method_not_allowed")
        if status == 413:
            return body_too_large()
        if status < 500:
            return BadRequest(str(exc.detail), code="bad_request", reason="bad_input")
    return internal_error(exc)
