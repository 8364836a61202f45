"""A test's or a bench's settings come from itself alone, never from a system install on the
same machine.

`Settings()` reads $CHAT_APPLIANCE_CONFIG, else /etc/chat-appliance/config.toml when it exists
(a system install puts a generated API key there). So every process a test starts, and the test
process itself, gets CHAT_APPLIANCE_CONFIG pointing at NO_CONFIG (a TOML file with no settings)
and none of the caller's own CHAT_APPLIANCE_* settings; a test that wants a file sets its own.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from appliance.core.sections import CONFIG_ENV
from appliance.core.settings import Settings

PREFIX = "CHAT_APPLIANCE_"
NO_CONFIG = Path(__file__).with_name("no-config.toml")


def names_a_setting(key: str) -> bool:
    """CHAT_APPLIANCE_CONFIG or CHAT_APPLIANCE_<GROUP>__...: what Settings() would read
    (test tooling's own variables, CHAT_APPLIANCE_TEST_ARTIFACTS say, are left alone)."""
    if not key.startswith(PREFIX):
        return False
    group = key.removeprefix(PREFIX).lower().split("__", 1)[0]
    return key == CONFIG_ENV or group in Settings.model_fields


def isolate(environ: MutableMapping[str, str]) -> None:
    """Drop every setting `environ` carries and point the config file at NO_CONFIG."""
    for key in [key for key in environ if names_a_setting(key)]:
        del environ[key]
    environ[CONFIG_ENV] = str(NO_CONFIG)


def clean_env() -> dict[str, str]:
    """This process's environment for a child process, with no settings but the empty file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env[CONFIG_ENV] = str(NO_CONFIG)
    return env
