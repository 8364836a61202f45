"""The clients table: keys to clients in constant time, anonymous keys, reloads that keep the
old table on a bad configuration."""

from __future__ import annotations

import hashlib

import pytest
from structlog.testing import capture_logs

from appliance.admission.clients import ANONYMOUS, Client, ClientTable, Roster
from appliance.core.errors import Unauthorized
from appliance.core.settings import ConfigError, Settings

BATCH_KEY = "sk-batch-secret"
UI_KEY = "sk-ui-secret"


def settings(**admission: object) -> Settings:
    clients = [{"name": "batch", "key": BATCH_KEY, "max_inflight": 2, "tokens_per_minute": 900,
                "max_tokens": 64, "routes": ["/v1/chat/completions"], "priority": 5},
               {"name": "ui", "key_sha256": hashlib.sha256(UI_KEY.encode()).hexdigest().upper()}]
    return Settings(server={"api_keys": ["sk-plain"]},
                    admission={"clients": clients, "default_priority": -1, **admission})


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_a_named_clients_key_gives_its_limits_and_priority() -> None:
    batch = ClientTable.from_settings(settings()).identify(bearer(BATCH_KEY))
    assert batch == Client("batch", priority=5, max_inflight=2, tokens_per_minute=900,
                           max_tokens=64, routes=("/v1/chat/completions",))


def test_a_key_given_as_its_sha256_is_recognised_and_gets_the_default_priority() -> None:
    ui = ClientTable.from_settings(settings()).identify(bearer(UI_KEY))
    assert ui == Client("ui", priority=-1)


def test_a_plain_api_key_is_the_anonymous_client_with_the_defaults() -> None:
    plain = ClientTable.from_settings(settings()).identify(bearer("sk-plain"))
    assert plain == Client(ANONYMOUS, priority=-1)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic sk-plain", bearer("sk-nope"),
                                    bearer(hashlib.sha256(UI_KEY.encode()).hexdigest())])
def test_anything_but_a_configured_key_is_401_and_the_message_holds_no_key(header: str | None) -> None:
    with pytest.raises(Unauthorized) as refused:
        ClientTable.from_settings(settings()).identify(header)
    assert refused.value.code == "invalid_api_key"
    for secret in (BATCH_KEY, UI_KEY, "sk-plain", "sk-nope"):
        assert secret not in refused.value.message


def test_with_no_key_configured_everyone_is_anonymous() -> None:
    table = ClientTable.from_settings(Settings())
    assert table.identify(None) == table.identify(bearer("anything")) == Client(ANONYMOUS)


def test_allowed_routes_are_exact_paths_or_prefixes_ending_in_a_star() -> None:
    client = Client("c", routes=("/v1/chat/completions", "/v1/models*"))
    assert client.may_use("/v1/chat/completions")
    assert client.may_use("/v1/models") and client.may_use("/v1/models/{model:path}")
    assert not client.may_use("/v1/completions")
    assert Client("all").may_use("/anything")


def test_a_reload_puts_the_new_keys_in_force() -> None:
    roster = Roster.from_settings(settings())
    with capture_logs() as logs:
        table = roster.reload(lambda: Settings(admission={"clients": [
            {"name": "fresh", "key": "sk-fresh"}]}))
    assert roster.generation == 2 and table.names == ["fresh"]
    assert roster.identify(bearer("sk-fresh")).name == "fresh"
    with pytest.raises(Unauthorized):
        roster.identify(bearer(BATCH_KEY))
    assert [entry["event"] for entry in logs] == ["clients.reloaded"]
    assert "sk-fresh" not in str(logs)


def test_a_bad_configuration_keeps_the_table_in_force_and_says_why() -> None:
    roster = Roster.from_settings(settings())

    def broken() -> Settings:
        raise ConfigError("admission.clients.0.max_inflight: Input should be >= 1")

    with capture_logs() as logs, pytest.raises(ConfigError):
        roster.reload(broken)
    assert roster.generation == 1 and roster.identify(bearer(BATCH_KEY)).name == "batch"
    assert logs[0]["event"] == "clients.reload_failed"
    assert "max_inflight" in logs[0]["error"]


def test_a_reload_that_adds_priorities_to_a_first_come_worker_says_it_needs_a_restart() -> None:
    roster = Roster.from_settings(Settings(admission={"clients": [{"name": "a", "key": "k"}]}))
    with capture_logs() as logs:
        roster.reload(settings)
    assert "clients.priority_needs_restart" in [entry["event"] for entry in logs]


@pytest.mark.parametrize("admission", [
    {"clients": [{"name": "a", "key": "k"}, {"name": "a", "key": "l"}]},
    {"clients": [{"name": "a", "key": "k"}, {"name": "b", "key": "k"}]},
    {"clients": [{"name": "a", "key": "k", "key_sha256": "0" * 64}]},
    {"clients": [{"name": "a"}]},
    {"clients": [{"name": "bad name", "key": "k"}]},
    {"clients": [{"name": "a", "key_sha256": "xyz"}]},
])
def test_an_ambiguous_or_malformed_clients_table_is_a_config_error_that_shows_no_key(
        admission: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from appliance.core.settings import load_settings

    monkeypatch.setenv("CHAT_APPLIANCE_ADMISSION__CLIENTS", json.dumps(admission["clients"]))
    with pytest.raises(ConfigError) as refused:
        load_settings()
    message = str(refused.value)
    assert "client" in message and message.count("\n") == 0
    assert '"k"' not in message and "'k'" not in message


def test_engine_priority_is_on_when_a_client_or_the_default_sets_one() -> None:
    assert not Settings().admission.engine_priority()
    assert settings().admission.engine_priority()
    assert Settings(admission={"default_priority": 2}).admission.engine_priority()
    assert not settings(priority_scheduling="off").admission.engine_priority()
    assert Settings(admission={"priority_scheduling": "on"}).admission.engine_priority()
