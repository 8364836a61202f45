"""Settings sources and precedence: defaults < TOML < environment; bad values name their key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core.settings import ConfigError, load_settings, masked_dump
from load.kit.isolation import NO_CONFIG


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("CHAT_APPLIANCE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(NO_CONFIG))  # never /etc's


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_bind_the_worker_to_loopback_and_serve_the_bundled_model() -> None:
    settings = load_settings()
    assert settings.server.port == 8000
    assert settings.engine.host == "127.0.0.1"
    assert settings.engine.model.endswith("SmolLM2-135M-Instruct")
    assert settings.policy.max_n == 2


def test_toml_file_overrides_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path, "[server]\nport = 9000\n[policy]\nmax_n = 4\n")
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(config))
    settings = load_settings()
    assert (settings.server.port, settings.policy.max_n) == (9000, 4)


def test_environment_overrides_toml_with_double_underscore_nesting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, "[server]\nport = 9000\n[engine]\nport = 8200\n")
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(config))
    monkeypatch.setenv("CHAT_APPLIANCE_SERVER__PORT", "8000")
    monkeypatch.setenv("CHAT_APPLIANCE_ENGINE__MODEL", "/models/x")
    settings = load_settings()
    assert settings.server.port == 8000
    assert settings.engine.port == 8200  # from the file: the env did not name it
    assert settings.engine.model == "/models/x"


def test_bad_value_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_SERVER__PORT", "eighty")
    with pytest.raises(ConfigError, match=r"^server\.port: "):
        load_settings()


def test_bad_value_in_toml_names_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(write(tmp_path, "[policy]\nmax_n = 0\n")))
    with pytest.raises(ConfigError, match=r"policy\.max_n"):
        load_settings()


def test_unknown_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(write(tmp_path, "[server]\nprot = 1\n")))
    with pytest.raises(ConfigError, match=r"server\.prot"):
        load_settings()


def test_worker_may_not_listen_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_ENGINE__HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match=r"engine\.host: .*loopback"):
        load_settings()


def test_missing_config_file_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", "/nonexistent/config.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings()


def test_api_keys_are_masked_in_the_dump(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_APPLIANCE_SERVER__API_KEYS", '["sk-very-secret"]')
    settings = load_settings()
    assert settings.server.api_keys[0].get_secret_value() == "sk-very-secret"
    assert "sk-very-secret" not in str(masked_dump(settings))
    assert "sk-very-secret" not in repr(settings)


def test_check_config_exits_2_with_one_line_naming_the_key() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.main", "check-config"],
        env={"CHAT_APPLIANCE_POLICY__MAX_INFLIGHT": "-3", "PATH": "/usr/bin"},
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "policy.max_inflight" in result.stderr


def test_example_config_file_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[3] / "config" / "chat-appliance.toml"
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(example))
    load_settings()


def test_every_setting_is_documented_in_the_example_with_its_default() -> None:
    """A new limit cannot ship without its line in config/ (STYLE: every limit is a setting
    with a documented default)."""
    import tomllib

    from appliance.core.settings import Settings

    example = Path(__file__).resolve().parents[3] / "config" / "chat-appliance.toml"
    sections: dict[str, dict[str, object]] = {}
    current = ""
    for line in example.read_text().splitlines():
        if line.removeprefix("# ").startswith("[") and line.rstrip().endswith("]"):
            current = line.removeprefix("# ").strip("[] \n")  # "# [models.<name>]" documented
            sections[current] = {}
        elif line.startswith("# ") and " = " in line and current:
            key, _, value = line[2:].partition(" = ")
            if key.isidentifier():
                parsed = tomllib.loads(f"v = {value.split('  #')[0]}")["v"]
                sections[current].setdefault(key, parsed)
    from appliance.core.catalog import ModelSettings

    defaults = Settings().model_dump(mode="json")
    for group, fields in Settings.model_fields.items():
        model = fields.annotation
        assert model is not None
        if group == "models":  # a table per model: each key documented under [models.<name>]
            for name in ModelSettings.model_fields:
                assert name in sections.get("models.<name>", {}), f"[models.<name>] {name}"
            continue
        for name in model.model_fields:  # type: ignore[union-attr]
            assert name in sections.get(group, {}), f"[{group}] {name} is not in {example.name}"
            default = defaults[group][name]
            if isinstance(default, int | float) and not isinstance(default, bool):
                assert sections[group][name] == default, f"[{group}] {name}: default {default}"
