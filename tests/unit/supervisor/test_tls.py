"""HTTPS on the API port, on the real `serve` over the synthetic worker (TLS is the server's
business; the engine is not under test): TLS only, the README's SDK snippets trust the
certificate, and a rotated certificate is served after a reload, without a restart."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.core.settings import ConfigError, load_settings
from load.kit.certs import der_sha256, self_signed
from supervisor.operator.tls import fingerprint
from tests.support.stack import ROOT, Stack, running_stack

README = ROOT / "README.md"
PLACEHOLDER_URL = "https://appliance.lan:8000"
PLACEHOLDER_CA = "/etc/chat-appliance/tls/cert.pem"
KEY = "sk-tls-test"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, Path]]:
    """serve with a certificate at fixed paths (the ones rotation overwrites)."""
    workdir = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(workdir, "first")
    settings = {"server.tls_certfile": str(cert), "server.tls_keyfile": str(key),
                "server.api_keys": [KEY]}
    with running_stack(workdir, settings, ("--tokens", "4")) as stack:
        yield stack, cert, key


def port_of(stack: Stack) -> int:
    return int(stack.url.rsplit(":", 1)[1])


def presented(stack: Stack) -> tuple[str, ssl.SSLSocket]:
    """A new connection: the SHA-256 of the certificate it got, and the connection itself."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # what is shown, not trust
    raw = socket.create_connection(("127.0.0.1", port_of(stack)), timeout=10)
    conn = context.wrap_socket(raw, server_hostname="localhost")
    der = conn.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest(), conn


def get_livez(conn: ssl.SSLSocket) -> bytes:
    conn.sendall(b"GET /livez HTTP/1.1\r\nHost: localhost\r\n\r\n")
    return conn.recv(4096)


def reload_command(stack: Stack) -> subprocess.CompletedProcess[str]:
    """`chat-appliance reload` as the operator runs it: it finds the socket by the port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    env["CHAT_APPLIANCE_SERVER__PORT"] = str(port_of(stack))
    return subprocess.run([sys.executable, "-m", "supervisor.main", "reload"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_plain_http_on_the_tls_port_is_refused_not_served(
        tls: tuple[Stack, Path, Path]) -> None:
    stack, _, _ = tls
    with socket.create_connection(("127.0.0.1", port_of(stack)), timeout=10) as raw:
        raw.sendall(b"GET /livez HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = b""
        while chunk := raw.recv(4096):  # until the appliance closes the connection
            answer += chunk
    assert b"HTTP/" not in answer and b"alive" not in answer
    assert httpx.get(f"{stack.url}/livez", verify=stack.verify, timeout=10).json() == {
        "alive": True}


def readme_tls_block() -> str:
    (block,) = re.findall(r"^```python tls\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert PLACEHOLDER_URL in block and PLACEHOLDER_CA in block
    return block


def test_the_readme_sdk_examples_trust_the_certificate(tls: tuple[Stack, Path, Path]) -> None:
    """The README's OpenAI and Anthropic snippets, run as written but for URL, file and key."""
    stack, cert, _ = tls
    script = (readme_tls_block().replace(PLACEHOLDER_URL, stack.url)
              .replace(PLACEHOLDER_CA, str(cert)).replace("YOUR-KEY", KEY))
    env = {key: value for key, value in os.environ.items()
           if not key.lower().endswith("_proxy") and not key.startswith(("OPENAI_", "ANTHROPIC_"))}
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", script],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 2
    # Without the certificate the same client refuses the appliance: the trust is what works.
    untrusted = script.replace(f'cafile="{cert}"', "")
    refused = subprocess.run([sys.executable, "-c", untrusted], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
    assert refused.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr


def test_a_rotated_certificate_serves_new_connections_after_reload(
        tls: tuple[Stack, Path, Path], tmp_path: Path) -> None:
    stack, cert, key = tls
    before, kept = presented(stack)
    with kept:
        new_cert, new_key = self_signed(tmp_path, "second")
        shutil.copyfile(new_cert, cert)
        shutil.copyfile(new_key, key)
        result = reload_command(stack)
        assert result.returncode == 0, result.stderr
        assert fingerprint(cert) in result.stdout
        after, fresh = presented(stack)
        fresh.close()
        assert before != after == der_sha256(new_cert)
        assert get_livez(kept).startswith(b"HTTP/1.1 200")  # an open one is still served


def test_a_pair_that_does_not_load_keeps_the_certificate_in_force(
        tls: tuple[Stack, Path, Path], tmp_path: Path) -> None:
    stack, cert, _ = tls
    in_force, conn = presented(stack)
    conn.close()
    original = cert.read_bytes()
    other_cert, _ = self_signed(tmp_path, "mismatch")
    shutil.copyfile(other_cert, cert)  # a certificate whose key is not the one beside it
    try:
        result = reload_command(stack)
        assert result.returncode == 2 and "tls_certfile" in result.stderr
        now, conn = presented(stack)
        conn.close()
        assert now == in_force
    finally:
        cert.write_bytes(original)


def test_a_certificate_without_its_key_is_a_configuration_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_SERVER__TLS_CERTFILE", "/etc/ssl/cert.pem")
    with pytest.raises(ConfigError, match="tls_certfile and tls_keyfile go together"):
        load_settings()


def test_serve_with_an_unreadable_certificate_exits_2_naming_the_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    env |= {"CHAT_APPLIANCE_SERVER__TLS_CERTFILE": str(tmp_path / "missing.pem"),
            "CHAT_APPLIANCE_SERVER__TLS_KEYFILE": str(tmp_path / "missing.key"),
            "CHAT_APPLIANCE_ENGINE__COMMAND": '["true"]'}
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "serve"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "server.tls_certfile" in result.stdout + result.stderr


def test_the_fingerprint_is_the_one_openssl_prints(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    printed = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in",
                              str(cert)], capture_output=True, text=True, check=True).stdout
    assert printed.strip().split("=", 1)[1] == fingerprint(cert)


def test_an_idle_tls_client_does_not_hold_the_stop(tmp_path: Path) -> None:
    """A kept-alive client that never answers the TLS close: the stop goes on after
    server.close_timeout_s, not after asyncio's 30 s wait for the peer's close_notify."""
    cert, key = self_signed(tmp_path, "stop")
    settings = {"server.tls_certfile": str(cert), "server.tls_keyfile": str(key)}
    with running_stack(tmp_path, settings, ("--tokens", "4")) as stack:
        _, idle = presented(stack)
        with idle:
            assert get_livez(idle).startswith(b"HTTP/1.1 200")  # kept alive, never read again
            stack.proc.send_signal(signal.SIGTERM)
            assert stack.proc.wait(timeout=20) == 0
