"""deploy/fleet/vllm-router.service: systemd accepts it, it runs the router from the venv
install.sh --router made, and its settings file names every variable the unit uses."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.supervisor.test_systemd_unit import directives

FLEET = Path(__file__).resolve().parents[1].parent / "deploy" / "fleet"
UNIT = FLEET / "vllm-router.service"
ENV = FLEET / "router.env"
INSTALLED_EXEC = "/opt/chat-appliance/router-venv/bin/vllm-router"


def values(key: str) -> list[str]:
    return [value for k, value in directives(UNIT.read_text()) if k == key]


def exec_start() -> str:
    """ExecStart with its continuation lines joined."""
    text = UNIT.read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """As for the appliance's own unit: any message at all fails (verify exits 0 on many)."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not found: install Debian's `systemd` package (apt-get "
                    "install systemd); .ci/run does")
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_EXEC} " in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(INSTALLED_EXEC, sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(copy)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


def test_every_variable_the_unit_uses_is_set_in_the_shipped_settings() -> None:
    """An unset ${X} is an empty argument: the router would refuse to start."""
    used = set(re.findall(r"\$\{?([A-Z_]+)\}?", exec_start()))
    assigned = {line.split("=", 1)[0] for line in ENV.read_text().splitlines()
                if line and not line.startswith("#")}
    assert used and used <= assigned, used - assigned
    assert values("EnvironmentFile") == ["/etc/chat-appliance/router.env"]


def test_the_router_probes_readiness_and_retries_elsewhere() -> None:
    args = exec_start().split()
    assert args[args.index("--health-check-endpoint") + 1] == "/readyz"
    assert args[args.index("--health-failure-threshold") + 1] == "1"  # a drain is out at once
    assert "--disable-retries" not in args and "--disable-circuit-breaker" not in args
    assert "--api-key" not in args  # the client's own key passes through (docs/fleet.md)


def test_install_router_lays_out_the_router_box_under_the_prefix(tmp_path: Path) -> None:
    """--router installs only the router: its own venv, its settings, the unit (the paths the
    unit and docs/fleet.md name), and the pinned package the unit was written for."""
    root = Path(__file__).resolve().parents[2]
    script = ('source ./install.sh\nparse_args --router\nset_layout\n'
              'echo "$MODE|$ROUTER_VENV|$ROUTER_ENV|$UNIT_DIR|$ROUTER_PACKAGE"')
    result = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "CHAT_APPLIANCE_PREFIX": str(tmp_path)},
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    mode, venv, env, units, package = result.stdout.strip().split("|")
    assert mode == "router" and package == "vllm-router==0.1.17"
    assert venv == f"{tmp_path}{INSTALLED_EXEC.removesuffix('/bin/vllm-router')}"
    assert env == f"{tmp_path}{values('EnvironmentFile')[0]}"
    assert units == f"{tmp_path}/etc/systemd/system"
