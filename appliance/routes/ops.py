"""Operational routes: /health (readiness with detail), /readyz (readiness, open), /livez
(liveness, open), /metrics (Prometheus). With several models, "the engine" below is every
model that must be up: the default and each pinned one.

A router or load balancer asks /readyz: 200 means "send me a new request"; 503 with Retry-After
while the engine starts, restarts or the box is draining. systemd and monitoring ask /livez: 200
while the supervisor's loop runs, whatever the engine does. Neither holds data, so neither needs
the key a router does not have; /health gives the same verdict, and the engine's detail to a
caller allowed it (a key, with server.protect_ops_routes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.types import Scope

from appliance.admission.slots import Admission
from appliance.core.engine import EngineState
from appliance.observe.metrics import RequestMetrics
from appliance.routes.handlers import get
from appliance.routes.models import ServedModels

QUIET = {"quiet": True}  # polled: an access line each would drown the log


def guarded_routes(metrics: RequestMetrics) -> list[HTTPRouteHandler]:
    """Open by default; behind the key guard with server.protect_ops_routes."""

    @get("/metrics", opt=QUIET, sync_to_thread=False)
    def metrics_route() -> Response[bytes]:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    return [metrics_route]


def health_route(models: ServedModels, admission: Admission,
                 detailed: Callable[[Scope], bool]) -> HTTPRouteHandler:
    """/health: the readiness verdict to anyone; the engine's detail only where `detailed`
    (open by default; with server.protect_ops_routes, a key allowed /health). A keyless caller
    gets the verdict, never a 401: vllm-router probes /health without a key before it serves.

    Ready: the default model and every pinned one are ready (another model's restart is that
    model's 503s, not the box's). The detail is the default model's engine at the top, as with
    one model, and every model's under `models`."""

    @get("/health", opt=QUIET, sync_to_thread=False)
    def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        blocking = models.not_ready()
        engine = (blocking or models.default).engine
        headers = {} if blocking is None else {"Retry-After": str(engine.retry_after_s())}
        if detailed(request.scope):
            detail = models.default.engine.snapshot() | {
                "in_flight": admission.in_flight, "queued": admission.queued,
                "models": {model.name: models.detail(model) for model in models}}
        else:
            detail = {"ready": blocking is None, "state": engine.state.value}
        return Response(content=detail, status_code=200 if blocking is None else 503,
                        headers=headers)

    return health


def open_routes(alive: Callable[[], bool], models: ServedModels) -> list[HTTPRouteHandler]:
    """Always open: a liveness or readiness probe must never need a secret."""

    @get("/livez", opt=QUIET, sync_to_thread=False)
    def livez() -> Response[dict[str, bool]]:
        ok = alive()
        return Response(content={"alive": ok}, status_code=200 if ok else 503)

    @get("/readyz", opt=QUIET, sync_to_thread=False)
    def readyz() -> Response[dict[str, Any]]:
        # The verdict alone (and the state, which names why not): a router acts on the status.
        blocking = models.not_ready()
        if blocking is None:
            return Response(content={"ready": True, "state": EngineState.READY.value},
                            status_code=200)
        return Response(content={"ready": False, "state": blocking.engine.state.value},
                        status_code=503,
                        headers={"Retry-After": str(blocking.engine.retry_after_s())})

    return [livez, readyz]
