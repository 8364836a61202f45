"""Operational routes: /health (readiness), /livez (liveness), /metrics (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Response
from litestar.handlers import HTTPRouteHandler

from appliance.admission.slots import Admission
from appliance.engine import EngineState, EngineView
from appliance.metrics import RequestMetrics
from appliance.routes.handlers import get

QUIET = {"quiet": True}  # polled: an access line each would drown the log


def guarded_routes(engine: EngineView, metrics: RequestMetrics,
                   admission: Admission) -> list[HTTPRouteHandler]:
    """Open by default; behind the key guard with server.protect_ops_routes."""

    @get("/health", opt=QUIET, sync_to_thread=False)
    def health() -> Response[dict[str, Any]]:
        ready = engine.state is EngineState.READY
        headers = {} if ready else {"Retry-After": str(engine.retry_after_s())}
        detail = engine.snapshot() | {"in_flight": admission.in_flight, "queued": admission.queued}
        return Response(content=detail, status_code=200 if ready else 503, headers=headers)

    @get("/metrics", opt=QUIET, sync_to_thread=False)
    def metrics_route() -> Response[bytes]:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    return [health, metrics_route]


def open_routes(alive: Callable[[], bool]) -> list[HTTPRouteHandler]:
    """Always open: a liveness probe must never need a secret."""

    @get("/livez", opt=QUIET, sync_to_thread=False)
    def livez() -> Response[dict[str, bool]]:
        ok = alive()
        return Response(content={"alive": ok}, status_code=200 if ok else 503)

    return [livez]
