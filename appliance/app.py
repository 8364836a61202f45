"""The Litestar application factory: routes wired to the engine view, the proxy and policy."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from appliance.engine import EngineState, EngineView
from appliance.errors import ApiError, error_body
from appliance.gate import Admitted, Gate
from appliance.metrics import Metrics
from appliance.proxy import Disconnected, Proxy
from appliance.settings import Settings

log = structlog.get_logger("appliance.app")

REQUEST_ID = "X-Request-Id"


def create_app(
    settings: Settings,
    engine: EngineView,
    *,
    alive: Callable[[], bool] = lambda: True,
    metrics: Metrics | None = None,
) -> Litestar:
    """Build the API around an engine view; nothing here reaches into the supervisor."""
    metrics = metrics or Metrics(engine)
    proxy = Proxy(engine, settings.server)
    gate = Gate(settings, engine, proxy, metrics)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await _generate(request, "/v1/chat/completions", "chat")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await _generate(request, "/v1/completions", "completion")

    async def _generate(request: Request[Any, Any, Any], path: str, kind: str) -> Response[Any]:
        request_id = request.headers[REQUEST_ID]  # made by _request_context when absent
        admitted = await gate.admit(request, kind)
        try:
            return await _forward(request, path, admitted, request_id)
        except BaseException:
            admitted.release()
            raise

    async def _forward(request: Request[Any, Any, Any], path: str, admitted: Admitted,
                       request_id: str) -> Response[Any]:
        headers = {"content-type": "application/json", REQUEST_ID: request_id}
        for attempt in (1, 2):
            if admitted.stream:
                upstream = await proxy.open("POST", path, admitted.body, headers)
                if upstream.status == 200:
                    upstream.on_close.append(admitted.release)
                    upstream.on_abandon.append(_count_abandoned)
                    return Stream(
                        proxy.relay(upstream), status_code=200,
                        headers=upstream.headers | admitted.headers | {
                            REQUEST_ID: request_id, "cache-control": "no-cache"},
                        media_type=upstream.headers.get("content-type", "text/event-stream"),
                    )
                content = await upstream.read_all()
            else:
                try:
                    upstream, content = await proxy.read("POST", path, admitted.body, headers,
                                                         _disconnect_waiter(request))
                except Disconnected:
                    admitted.release()
                    metrics.disconnects.labels(stream="false").inc()
                    log.info("request.client_disconnected", stream=False)
                    return Response(content=b"", status_code=499)
            # A budget the window cannot hold is refused by vLLM before anything is scheduled
            # (and before any byte of a stream): clamp it exactly and send once more.
            if upstream.status == 400 and attempt == 1 and await gate.refit(admitted):
                continue
            break
        admitted.release()
        return Response(content=content, status_code=upstream.status,
                        headers=upstream.headers | admitted.headers | {REQUEST_ID: request_id})

    def _count_abandoned() -> None:
        metrics.disconnects.labels(stream="true").inc()
        log.info("request.client_disconnected", stream=True)

    @get("/v1/models")
    async def models(request: Request[Any, Any, Any]) -> Response[Any]:
        gate.authenticate(request)
        upstream, content = await proxy.read("GET", "/v1/models", None, {},
                                             _disconnect_waiter(request))
        return Response(content=content, status_code=upstream.status, headers=upstream.headers)

    @get("/health")
    async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        gate.authenticate_ops(request)
        snapshot = engine.snapshot()
        ready = engine.state is EngineState.READY
        headers = {} if ready else {"Retry-After": str(engine.retry_after_s())}
        return Response(content=snapshot, status_code=200 if ready else 503, headers=headers)

    @get("/livez")
    async def livez(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        gate.authenticate_ops(request)
        ok = alive()
        return Response(content={"alive": ok}, status_code=200 if ok else 503)

    @get("/metrics")
    async def metrics_route(request: Request[Any, Any, Any]) -> Response[bytes]:
        gate.authenticate_ops(request)
        body, content_type = await metrics.render()
        return Response(content=body, media_type=content_type)

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.aclose()
            await gate.aclose()

    def api_error(request: Request[Any, Any, Any], exc: ApiError) -> Response[dict[str, Any]]:
        metrics.rejections.labels(reason=exc.reason).inc()
        log.info("request.rejected", status=exc.status, code=exc.code, param=exc.param,
                 reason=exc.reason)
        return Response(content=exc.body(), status_code=exc.status, headers=exc.headers())

    def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
        """Litestar's own refusals (413, 404, 405) in the OpenAI shape too."""
        reason = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "bad_input")
        metrics.rejections.labels(reason=reason).inc()
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        detail = exc.detail if exc.status_code != 413 else "request body too large"
        return Response(content=error_body(detail, type_, None, reason),
                        status_code=exc.status_code, headers=exc.headers or {})

    return Litestar(
        route_handlers=[chat_completions, completions, models, health, livez, metrics_route],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        middleware=[_request_context, metrics.middleware],
        lifespan=[lifespan],
        request_max_body_size=settings.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,  # the supervisor configures logging once, for the whole process
        debug=False,
    )


def _disconnect_waiter(request: Request[Any, Any, Any]) -> Callable[[], Any]:
    """A coroutine factory that returns once the client has gone away (body already read)."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait


def _request_context(app: ASGIApp) -> ASGIApp:
    """Bind the request id into every log line of the request (structlog contextvars)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        _set_header(scope, b"x-request-id", request_id)
        with structlog.contextvars.bound_contextvars(request_id=request_id,
                                                     path=scope.get("path")):
            await app(scope, receive, send)

    return middleware


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _set_header(scope: Scope, name: bytes, value: str) -> None:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != name]
    scope["headers"] = [*headers, (name, value.encode("latin-1"))]
