"""The suite never reads a system install's config: a poisoned /etc-style file stays unread.

The file is written where the test controls it and the default path (SYSTEM_CONFIG) is pointed
at it; the real /etc is never touched. The first test proves the poison would be read by a
process that is not isolated, so that the others can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core import settings as settings_module
from appliance.core.sections import CONFIG_ENV
from appliance.core.settings import Settings, load_settings
from load.kit.isolation import NO_CONFIG, clean_env, isolate

POISON = '[server]\napi_keys = ["sk-from-etc"]\n[policy]\nmax_n = 7\n'
READ = ("import sys; from pathlib import Path; import appliance.core.settings as s; "
        "s.SYSTEM_CONFIG = Path(sys.argv[1]); t = s.Settings(); "
        "print(t.policy.max_n, len(t.server.api_keys))")


@pytest.fixture
def poisoned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir()
    path.write_text(POISON)
    monkeypatch.setattr(settings_module, "SYSTEM_CONFIG", path)
    return path


def _read_in_child(env: dict[str, str], poisoned: Path) -> str:
    result = subprocess.run([sys.executable, "-c", READ, str(poisoned)], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip()


def test_the_poison_is_read_where_nothing_isolates_the_process(
        poisoned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV)
    assert Settings().policy.max_n == 7
    unisolated = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    assert _read_in_child(unisolated, poisoned) == "7 1"


def test_the_test_process_reads_no_system_config(poisoned: Path) -> None:
    assert os.environ[CONFIG_ENV] == str(NO_CONFIG)
    built, loaded = Settings(), load_settings()
    for settings in (built, loaded):
        assert settings.policy.max_n == 2 and settings.server.api_keys == []


def test_a_child_process_a_harness_starts_reads_no_system_config(poisoned: Path) -> None:
    assert _read_in_child(clean_env(), poisoned) == "2 0"


def test_isolation_drops_inherited_settings_and_keeps_tooling_variables() -> None:
    environ = {"CHAT_APPLIANCE_SERVER__API_KEYS": '["sk-mine"]', CONFIG_ENV: "/etc/x.toml",
               "CHAT_APPLIANCE_TEST_ARTIFACTS": "/tmp/a", "HOME": "/root"}
    isolate(environ)
    assert environ == {CONFIG_ENV: str(NO_CONFIG), "CHAT_APPLIANCE_TEST_ARTIFACTS": "/tmp/a",
                       "HOME": "/root"}
    assert "CHAT_APPLIANCE_TEST_ARTIFACTS" not in clean_env()
