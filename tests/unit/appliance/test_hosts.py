"""The Host check: the appliance answers its own names and addresses and the configured ones;
any other Host gets 421 in the route's error shape on every route, before anything else runs
(a page that rebound its name to the box reads nothing of it)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from litestar import Litestar

from appliance.app import create_app
from appliance.core.sections import ServerSettings
from appliance.core.settings import Settings
from appliance.edge.hosts import AllowedHosts
from tests.unit.appliance.fakes import FakeEngine
from tests.unit.appliance.routes.test_routes import every_route

pytestmark = pytest.mark.anyio
FOREIGN = "rebound.attacker.example:8000"


def hosts(interfaces: list[str] | None = None, **server: Any) -> AllowedHosts:
    given = ["192.168.1.5", "fe80::1%eth0"] if interfaces is None else interfaces
    return AllowedHosts(ServerSettings(**server),
                        machine_names=lambda: {"box", "box.lan", "box.local"},
                        interface_addresses=lambda: given)


@pytest.mark.parametrize("host", [
    "localhost", "localhost:8000", "LOCALHOST.", "app.localhost:8000", "127.0.0.1", "127.0.0.1:8000",
    "127.1.2.3:80", "[::1]", "[::1]:8000", "box", "Box.LAN:8000", "box.local", "192.168.1.5:8000",
    "[fe80::1]:8000"])
def test_its_own_names_and_addresses_are_answered_with_or_without_a_port(host: str) -> None:
    assert hosts().allows(host.encode())


@pytest.mark.parametrize("host", [
    FOREIGN, "attacker.example", "box.attacker.example", "localhost.attacker.example",
    "192.168.1.6", "[fe80::2]:8000", "box:http", "[::1]x", "[::1", "", ":8000", "b\xc3\xa4r"])
def test_any_other_host_is_refused(host: str) -> None:
    assert not hosts().allows(host.encode("latin-1"))


def test_no_host_at_all_is_answered_as_no_browser_sends_that() -> None:
    assert hosts().allows(None)


def test_the_setting_adds_names_and_the_star_answers_any_host() -> None:
    extra = hosts(allowed_hosts=["Fleet.LAN", "[2001:db8::7]", "203.0.113.9"])
    assert extra.allows(b"fleet.lan:8000") and extra.allows(b"[2001:db8::7]:80")
    assert extra.allows(b"203.0.113.9") and not extra.allows(FOREIGN.encode())
    assert hosts(allowed_hosts=["*"]).allows(FOREIGN.encode())
    with pytest.raises(ValueError, match="no port"):
        ServerSettings(allowed_hosts=["fleet.lan:8000"])


def test_a_specific_bind_address_or_name_is_answered() -> None:
    assert hosts(host="10.9.8.7").allows(b"10.9.8.7:8000")
    assert hosts(host="appliance.example").allows(b"appliance.example")
    assert not hosts(host="0.0.0.0").allows(b"0.0.0.0:8000")


def test_an_address_the_machine_was_given_since_start_is_answered() -> None:
    interfaces = ["192.168.1.5"]
    allowed = hosts(interfaces)
    assert not allowed.allows(b"10.0.0.42")
    interfaces.append("10.0.0.42")  # a new DHCP lease
    assert allowed.allows(b"10.0.0.42:8000")


def app_with(**server: Any) -> Litestar:
    return create_app(Settings(server={"api_keys": ["sk-hosts"], **server}),
                      FakeEngine("http://127.0.0.1:9"))


async def call(app: Litestar, method: str, path: str, host: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8000") as client:
        return await client.request(method, path, headers={"host": host},
                                    content=b"{}" if method == "POST" else None)


async def test_every_route_refuses_a_foreign_host_421_before_its_key_or_engine_is_asked() -> None:
    app = app_with()
    routes = [*every_route(app), ("GET", "/no/such/route"), ("DELETE", "/livez")]
    for path in ("/", "/status.json", "/health", "/livez", "/metrics", "/v1/chat/completions",
                 "/v1/messages"):
        assert any(p == path for _, p in routes), path
    for method, path in routes:
        response = await call(app, method, path, FOREIGN)
        assert response.status_code == 421, (method, path, response.text)
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        if path.startswith("/v1/messages"):  # Anthropic's SDK parses its own shape
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["code"] == "host_not_allowed", (method, path, body)
        assert "rebound.attacker.example" in str(body)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "[::1]:8000"])
async def test_loopback_hosts_reach_the_routes(host: str) -> None:
    app = app_with()
    assert (await call(app, "GET", "/livez", host)).status_code == 200
    assert (await call(app, "GET", "/health", host)).status_code == 200
    assert (await call(app, "POST", "/v1/chat/completions", host)).status_code == 401
    assert (await call(app, "GET", "/no/such/route", host)).status_code == 404


async def test_with_the_star_a_router_that_rewrites_host_reaches_the_routes() -> None:
    app = app_with(allowed_hosts=["*"])
    assert (await call(app, "GET", "/livez", FOREIGN)).status_code == 200
    assert (await call(app, "POST", "/v1/chat/completions", FOREIGN)).status_code == 401


async def test_a_refusal_is_counted_under_its_reason() -> None:
    app = app_with()
    await call(app, "GET", "/health", FOREIGN)
    metrics = (await call(app, "GET", "/metrics", "localhost")).text
    assert 'reason="host_not_allowed"' in metrics
    assert 'route="/health",status="421"' in metrics
