"""`chat-appliance reload` asks the control socket, and says why it could not reload, in its
exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from appliance.core.sections import CONFIG_ENV
from load.kit.isolation import NO_CONFIG
from load.kit.net import free_port


def reload(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.main", "reload", *args],
                          env={"PATH": "/usr/bin", CONFIG_ENV: str(NO_CONFIG), **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_nothing_answering_is_exit_3_naming_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    result = reload("--socket", str(path))
    assert result.returncode == 3 and str(path) in result.stderr


def test_by_default_it_asks_the_socket_of_the_configured_port() -> None:
    port = free_port()
    result = reload(CHAT_APPLIANCE_SERVER__PORT=str(port))
    assert result.returncode == 3 and f"control-{port}.sock" in result.stderr


def test_a_configuration_it_cannot_read_is_exit_2_with_the_key() -> None:
    result = reload(CHAT_APPLIANCE_ADMISSION__QUEUE_MAX="-1")
    assert result.returncode == 2 and "admission.queue_max" in result.stderr
