"""vllm-router (deploy/fleet/) in front of two appliances serving HTTPS with keys, as a system
install's boxes do: the router checks each box's certificate against the boxes' own
(SSL_CERT_FILE), probes the open /readyz without a key, and passes each client's Authorization
header through unchanged, so every box's clients table decides.

The boxes run the synthetic worker: what is under test is the router's configuration and the
boxes' contract with it, not the engine (load.fleet runs the real one)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from load.fleet.router import DEFAULT_BIN, Router, running_router
from tests.support.stack import running_stack

pytestmark = pytest.mark.synthetic
KEY = "sk-fleet-router"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def box_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A box's self-signed certificate as the router can trust it: marked CA:FALSE. The router
    (rustls) refuses a certificate marked CA:TRUE as a server's own, which is what a bare
    `openssl req -x509` makes; docs/fleet.md says how to make one."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-addext", "basicConstraints=critical,CA:FALSE",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def require_router() -> str:
    """The router is a prerequisite of this module, not an option: say how to get it."""
    if not os.access(DEFAULT_BIN, os.X_OK):
        raise AssertionError(f"vllm-router not found at {DEFAULT_BIN}: run `bash install.sh "
                             "--dev`, or set CHAT_APPLIANCE_ROUTER")
    return DEFAULT_BIN


def test_https_boxes_behind_the_router_with_the_clients_own_keys(tmp_path: Path) -> None:
    binary = require_router()
    cert, key = box_certificate(tmp_path, "box")
    settings = {"server.tls_certfile": str(cert), "server.tls_keyfile": str(key),
                "server.api_keys": [KEY], "server.protect_ops_routes": True}
    with contextlib.ExitStack() as stack:
        boxes = []
        for name in ("box1", "box2"):
            (tmp_path / name).mkdir()
            boxes.append(stack.enter_context(running_stack(tmp_path / name, settings,
                                                           ("--tokens", "4"))))
        assert all(box.url.startswith("https://") for box in boxes)
        router = stack.enter_context(running_router(
            binary, [box.url for box in boxes], "round_robin", tmp_path / "router.log",
            {"SSL_CERT_FILE": str(cert)}))
        assert router.healthy() == {box.url: True for box in boxes}  # /readyz, no key
        with httpx.Client(base_url=router.url, timeout=30) as client:
            right = [client.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": f"Bearer {KEY}"}) for _ in range(4)]
            wrong = [client.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": "Bearer sk-someone-else"})
                     for _ in range(4)]
            none = client.post("/v1/chat/completions", json=CHAT)
        assert [r.status_code for r in right] == [200] * 4
        assert all(r.json()["choices"][0]["message"]["content"] for r in right)
        # Refused by the box itself, in its error shape: the router neither dropped the header
        # nor put a key of its own in its place, and a 401 is not retried into an answer.
        assert [r.status_code for r in wrong] == [401] * 4
        assert {r.json()["error"]["code"] for r in wrong} == {"invalid_api_key"}
        assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
        # Round robin: both boxes answered (each counts its own 200s and 401s).
        for box in boxes:
            metrics = httpx.get(f"{box.url}/metrics", verify=box.verify, headers=box.headers,
                                timeout=10).text
            assert 'status="200"' in metrics and 'status="401"' in metrics


def test_the_router_trusts_only_the_certificates_it_is_given(tmp_path: Path) -> None:
    """SSL_CERT_FILE is what the router trusts: with another certificate there, or with the
    box's own made CA:TRUE, the box is never healthy and the router never serves."""
    binary = require_router()
    cert, key = box_certificate(tmp_path, "box")
    stranger, _ = box_certificate(tmp_path, "stranger")
    settings = {"server.tls_certfile": str(cert), "server.tls_keyfile": str(key)}
    with running_stack(tmp_path, settings, ("--tokens", "4")) as box:
        router = Router(binary, [box.url], "round_robin", tmp_path / "router.log",
                        {"SSL_CERT_FILE": str(stranger)})
        try:
            with pytest.raises(AssertionError, match="never became ready"):
                router.wait_ready(timeout_s=8)
        finally:
            router.stop()
        trusted = Router(binary, [box.url], "round_robin", tmp_path / "router.log",
                         {"SSL_CERT_FILE": str(cert)})
        try:
            trusted.wait_ready(timeout_s=30)  # the same box, its own certificate trusted
        finally:
            trusted.stop()
