"""The Host check on the real `serve` (supervisor, edge, API; the synthetic upstream as its
worker): a name that is not this machine's gets 421 on every route, over HTTP as a rebound
page's browser sends it, while the names the tests, the load tools and the CLI use are served,
and an operator's name in server.allowed_hosts is too."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import Appliance, running_synthetic_appliance

FOREIGN = "rebound.attacker.example"
ROUTES = [("GET", "/"), ("GET", "/status.json"), ("GET", "/health"), ("GET", "/livez"),
          ("GET", "/metrics"), ("POST", "/v1/chat/completions"), ("POST", "/v1/messages")]
CHAT = {"model": "synthetic", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_synthetic_appliance(tmp_path_factory.mktemp("hosts"), "--tokens", "4",
                                     server__allowed_hosts='["fleet.example"]') as running:
        running.wait_ready(60)
        yield running


def ask(appliance: Appliance, method: str, path: str, host: str) -> httpx.Response:
    return httpx.request(method, f"{appliance.url}{path}", headers={"host": host}, timeout=30,
                         json=CHAT if method == "POST" else None)


def test_a_foreign_host_is_refused_on_every_route(appliance: Appliance) -> None:
    port = appliance.url.rsplit(":", 1)[1]
    for method, path in ROUTES:
        refused = ask(appliance, method, path, f"{FOREIGN}:{port}")
        assert refused.status_code == 421, (path, refused.text)
        body = refused.json()
        error = body["error"]
        assert body.get("type") == "error" if path == "/v1/messages" else \
            error["code"] == "host_not_allowed"
        assert FOREIGN in error["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "fleet.example"])
def test_loopback_names_and_the_configured_ones_are_served(appliance: Appliance, host: str) -> None:
    port = appliance.url.rsplit(":", 1)[1]
    for method, path in ROUTES:
        answer = ask(appliance, method, path, f"{host}:{port}")
        assert answer.status_code == 200, (host, path, answer.text)


def test_the_status_command_reaches_it(appliance: Appliance) -> None:
    port = appliance.url.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "status"], env=env | {
        "CHAT_APPLIANCE_SERVER__PORT": port}, capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[2], check=False)
    assert result.returncode == 0, result.stdout + result.stderr
