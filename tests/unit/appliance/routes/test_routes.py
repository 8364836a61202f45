"""Every route answers to the rules declared on its router: a new route cannot ship open."""

from __future__ import annotations

import httpx
import pytest
from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler

from appliance.app import create_app
from appliance.core.engine import EngineState
from appliance.core.errors import EngineUnavailable
from appliance.core.settings import Settings
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio
KEY = "sk-routes-test-key"
# /livez and /readyz for liveness and readiness probes (a router has no client's key); the
# status page's shell and assets, which hold no data.
OPEN_ALWAYS = {"/livez", "/readyz", "/", "/ui/status.js", "/ui/chart.js", "/ui/status.css"}
OPS = {"/health", "/metrics", "/status.json"}
# The verdict to anyone (a router probes it without a key); its detail follows OPS's rule.
VERDICT_OPEN = {"/health"}


def every_route(app: Litestar) -> list[tuple[str, str]]:
    """(method, concrete path) for each handler the app serves, OPTIONS aside."""
    found = []
    for route in app.routes:
        path = route.path.replace("{model:path}", "some-model").replace(
            "{response_id:str}", "resp_some")
        for method in sorted(route.methods - {"OPTIONS", "HEAD"}):
            found.append((method, path))
    return found


def app_with(**server: object) -> Litestar:
    # The fake engine's port is dead: a request the guards let through waits resume.confirm_s
    # for the engine to be confirmed gone before it answers, so that wait is kept short.
    return create_app(Settings(server={"api_keys": [KEY], **server},
                               resume={"confirm_s": 0.05}),
                      FakeEngine("http://127.0.0.1:9"))


async def call(app: Litestar, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        return await client.request(method, path, headers=headers, content=b"{}")


@pytest.mark.parametrize("protect", [False, True])
async def test_every_route_but_the_open_ones_refuses_a_missing_or_wrong_key(protect: bool) -> None:
    app = app_with(protect_ops_routes=protect)
    routes = every_route(app)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/livez") in routes
    for method, path in routes:
        open_route = path in OPEN_ALWAYS | VERDICT_OPEN or (path in OPS and not protect)
        for key in (None, "sk-wrong"):
            response = await call(app, method, path, key)
            if open_route:
                assert response.status_code != 401, (method, path)
            else:
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["type"] == "authentication_error"


async def test_the_app_serves_the_readmes_surface_and_nothing_else() -> None:
    """Exactly the README's routes (its surface table, the operational ones, the status page):
    a route it lists as not served (vLLM's operator, scale-out or other-model routes) that
    gets a pass-through is a way around the gate to the worker."""
    assert set(every_route(app_with())) == {
        ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions/batch"), ("POST", "/invocations"),
        ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_some"),
        ("POST", "/v1/responses/resp_some/cancel"), ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"), ("POST", "/tokenize"), ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"), ("GET", "/version"), ("GET", "/v1/models"),
        ("GET", "/v1/models/some-model"),
        *(("GET", path) for path in OPEN_ALWAYS | OPS),
    }


async def test_only_the_anthropic_routes_take_the_key_as_x_api_key() -> None:
    app = app_with()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        for method, path in every_route(app):
            if path in OPEN_ALWAYS | OPS:
                continue
            response = await client.request(method, path, content=b"{}", headers={
                "content-type": "application/json", "x-api-key": KEY})
            anthropic = path.startswith("/v1/messages")
            assert (response.status_code != 401) is anthropic, (method, path)
            if anthropic:
                continue
            assert response.json()["error"]["type"] == "authentication_error"


async def test_livez_stays_open_under_protect_ops_routes() -> None:
    response = await call(app_with(protect_ops_routes=True), "GET", "/livez")
    assert response.status_code == 200 and response.json() == {"alive": True}


async def test_readyz_stays_open_under_protect_ops_routes() -> None:
    response = await call(app_with(protect_ops_routes=True), "GET", "/readyz")
    assert response.status_code == 200 and response.json() == {"ready": True, "state": "ready"}


async def test_health_gives_a_keyless_caller_the_verdict_and_a_key_holder_the_detail() -> None:
    """Under protect_ops_routes a router's keyless probe of /health (vllm-router's start-up
    check) learns ready or not, and nothing else; the detail still needs a key."""
    app = app_with(protect_ops_routes=True)
    for key in (None, "sk-wrong"):
        verdict = await call(app, "GET", "/health", key)
        assert verdict.status_code == 200 and verdict.json() == {"ready": True, "state": "ready"}
    detail = (await call(app, "GET", "/health", KEY)).json()
    assert detail["state"] == "ready" and detail["pid"] == 4242 and "in_flight" in detail
    open_detail = (await call(app_with(), "GET", "/health")).json()
    assert open_detail["pid"] == 4242  # not protected: the detail to anyone, as before


async def test_the_right_key_passes_the_guard_on_every_route() -> None:
    app = app_with(protect_ops_routes=True)
    for method, path in every_route(app):
        assert (await call(app, method, path, KEY)).status_code != 401, (method, path)


async def test_every_route_gives_its_guards_the_handler_itself_not_a_copy_per_request() -> None:
    """Litestar's own route classes copy the handler for each guard on every request (its
    automatic OPTIONS answers aside: preflights are rare)."""
    from appliance.routes.handlers import Handler

    app = app_with(protect_ops_routes=True)
    handlers = [h for route in app.routes for h in getattr(route, "route_handlers", [])
                if isinstance(h, HTTPRouteHandler) and "OPTIONS" not in h.http_methods]
    assert handlers and all(isinstance(h, Handler) for h in handlers), [
        h for h in handlers if not isinstance(h, Handler)]
    seen = []
    handler = next(h for h in handlers if "/v1/chat/completions" in h.paths)

    async def guard(_: object, given: object) -> None:
        seen.append(given)

    handler.guards = [guard]
    handler._resolved_guards = [guard]  # what resolve_guards() returns once resolved
    await handler.authorize_connection(object())  # type: ignore[arg-type]
    assert seen == [handler]


def api_handlers(app: Litestar) -> list[tuple[str, HTTPRouteHandler]]:
    """(concrete path, handler) of every route of the API families (no ops, open or admin)."""
    found = []
    for route in app.routes:
        path = route.path.replace("{model:path}", "some-model").replace(
            "{response_id:str}", "resp_some")
        if path in OPEN_ALWAYS | OPS:
            continue
        found += [(path, h) for h in getattr(route, "route_handlers", [])
                  if isinstance(h, HTTPRouteHandler) and "OPTIONS" not in h.http_methods]
    return found


async def test_every_api_route_declares_that_the_engine_must_be_ready() -> None:
    """The 503 comes from the routers' guards, before any handler runs, so a new API route
    cannot forget it; it keeps Retry-After and the route's own error shape."""
    engine = FakeEngine("http://127.0.0.1:9", state=EngineState.BACKOFF)
    app = create_app(Settings(server={"api_keys": [KEY]}), engine)
    handlers = api_handlers(app)
    assert len(handlers) >= 14, handlers
    for path, handler in handlers:
        scope = {"type": "http", "path": path, "state": {}, "headers": [
            (b"authorization", f"Bearer {KEY}".encode())]}
        with pytest.raises(EngineUnavailable):
            for guard in handler.resolve_guards():
                await guard(ASGIConnection(scope), handler)  # type: ignore[arg-type]
        method = next(iter(handler.http_methods))
        response = await call(app, method, path, KEY)
        assert response.status_code == 503 and response.headers["retry-after"] == "7", path
        error = response.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        else:
            assert error["error"]["code"] == "engine_unavailable", (path, error)
