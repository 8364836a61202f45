"""install.sh --system makes the API's TLS certificate (for this host's names and addresses, its
key the service user's alone, its fingerprint printed) and writes a config that uses it and
keeps the operational routes behind the key."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from appliance.core.settings import load_settings
from supervisor.operator.tls import fingerprint

ROOT = Path(__file__).resolve().parents[2]
# The service user need not exist here: chown is recorded, not run.
FAKE_CHOWN = 'chown() { echo "chown $*" >> "$PREFIX/chown.log"; }\n'


def install_step(script: str, prefix: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `script` after sourcing install.sh, in system mode under a test prefix."""
    setup = (f'source ./install.sh\nMODE=system\nPREFIX="{prefix}"\nLOG="{prefix}/install.log"\n'
             f'CONFIG_FILE="$PREFIX/etc/chat-appliance/config.toml"\nAPP_VENV="{ROOT}/.venv"\n'
             + FAKE_CHOWN)
    return subprocess.run(["bash", "-c", setup + script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={"PATH": os.environ["PATH"], "TMPDIR": str(prefix), **env})


def test_a_self_signed_certificate_for_this_host_with_a_private_key(tmp_path: Path) -> None:
    result = install_step("ensure_tls_certificate", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    cert = tmp_path / "etc/chat-appliance/tls/cert.pem"
    key = tmp_path / "etc/chat-appliance/tls/key.pem"
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(cert)],
                          capture_output=True, text=True, check=True).stdout
    names = ["DNS:localhost", "IP Address:127.0.0.1", f"DNS:{socket.gethostname()}"]
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                               check=False).stdout.split()
    names += [f"IP Address:{a}" for a in addresses if ":" not in a]  # openssl prints v6 long
    assert all(name in text for name in names), text
    assert "CA:FALSE" in text  # a server's own certificate: rustls (vllm-router) refuses a CA
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"chown chat-appliance:chat-appliance -- {key}" in (tmp_path / "chown.log").read_text()
    assert fingerprint(cert) in result.stdout
    again = install_step("ensure_tls_certificate", tmp_path)
    assert "already present" in again.stdout and fingerprint(cert) in again.stdout


def test_a_given_pair_is_used_as_it_is(tmp_path: Path) -> None:
    from load.kit.certs import self_signed

    cert, key = self_signed(tmp_path, "operator")
    result = install_step('ensure_tls_certificate\necho "use $TLS_CERTFILE $TLS_KEYFILE"',
                          tmp_path, CHAT_APPLIANCE_SERVER__TLS_CERTFILE=str(cert),
                          CHAT_APPLIANCE_SERVER__TLS_KEYFILE=str(key))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"use {cert} {key}" in result.stdout
    assert not (tmp_path / "etc/chat-appliance/tls").exists()


def test_the_system_config_protects_the_ops_routes_and_serves_https(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    layout = 'ENGINE_LINK="$PREFIX/opt/engine-venv"\nMODELS_LINK="$PREFIX/var/lib/models"\n'
    result = install_step(f'{layout}ensure_tls_certificate >/dev/null\nrender_config "{config}"',
                          tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(config))
    server = load_settings().server
    assert server.protect_ops_routes is True
    assert server.tls_certfile == tmp_path / "etc/chat-appliance/tls/cert.pem"
    assert server.tls_keyfile == tmp_path / "etc/chat-appliance/tls/key.pem"
    assert [k.get_secret_value() for k in server.api_keys] == [result.stdout.strip()]
