"""`chat-appliance reload` says why it could not reload, in its exit status."""

from __future__ import annotations

import subprocess
import sys

from appliance.settings import CONFIG_ENV
from tests.net import free_port
from tests.support.isolation import NO_CONFIG


def reload(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.main", "reload", *args],
                          env={"PATH": "/usr/bin", CONFIG_ENV: str(NO_CONFIG), **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_nothing_answering_is_exit_3_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = reload("--url", url)
    assert result.returncode == 3 and url in result.stderr


def test_a_configuration_it_cannot_read_is_exit_2_with_the_key() -> None:
    result = reload(CHAT_APPLIANCE_ADMISSION__QUEUE_MAX="-1")
    assert result.returncode == 2 and "admission.queue_max" in result.stderr
