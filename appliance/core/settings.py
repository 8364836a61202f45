"""The one settings tree: defaults < TOML file < CHAT_APPLIANCE_* environment variables. Its
groups, one per section of the file, are in appliance.core.sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from appliance.core.catalog import ModelSettings, ResidencySettings, check_catalog
from appliance.core.sections import (
    CONFIG_ENV,
    ENV_PREFIX,
    SYSTEM_CONFIG,
    AdmissionSettings,
    CanarySettings,
    ConstraintSettings,
    CrashSettings,
    DoctorSettings,
    EngineSettings,
    GpuSettings,
    LoggingSettings,
    PolicySettings,
    ResumeSettings,
    ServerSettings,
    StatusSettings,
    SupervisorSettings,
    key_digest,
)


class Settings(BaseSettings):
    """Everything the appliance reads at start, built once and passed explicitly."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    constraints: ConstraintSettings = Field(default_factory=ConstraintSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    status: StatusSettings = Field(default_factory=StatusSettings)
    doctor: DoctorSettings = Field(default_factory=DoctorSettings)
    crashes: CrashSettings = Field(default_factory=CrashSettings)
    resume: ResumeSettings = Field(default_factory=ResumeSettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    # The catalog ([models.<name>] tables, appliance.core.catalog); empty: [engine]'s one model.
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    residency: ResidencySettings = Field(default_factory=ResidencySettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: explicit arguments, environment, then the TOML file.
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = config_path()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @model_validator(mode="after")
    def _keys_name_one_client(self) -> Settings:
        owners: dict[str, list[str]] = {}
        for index, key in enumerate(self.server.api_keys):
            owners.setdefault(key_digest(key), []).append(f"server.api_keys[{index}]")
        for client in self.admission.clients:
            owners.setdefault(client.digest(), []).append(f"client '{client.name}'")
        shared = [" and ".join(names) for names in owners.values() if len(names) > 1]
        if shared:
            raise ValueError(f"one key names one caller: {'; '.join(shared)} have the same key")
        return self

    @model_validator(mode="after")
    def _one_name_per_model(self) -> Settings:
        check_catalog(self.models, self.engine, self.residency)
        return self

    def model_key(self, key: str) -> str:
        """The setting an operator changes for this tree's model's `key`: its own table in a
        catalog (this is then a model's tree, appliance.core.catalog.CatalogEntry.settings),
        else [engine]'s."""
        if self.models:
            return f"models.{self.engine.model_name}.{key}"
        return f"engine.{key}"


class ConfigError(Exception):
    """A setting is wrong; the message is one line naming the key."""


def config_path() -> Path | None:
    """The TOML file in force: $CHAT_APPLIANCE_CONFIG if set, else /etc's if it exists."""
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit)
    return SYSTEM_CONFIG if SYSTEM_CONFIG.is_file() else None


def load_settings(**overrides: Any) -> Settings:
    """Build the settings tree, or raise ConfigError with one line per bad key."""
    path = config_path()
    if path is not None and not path.is_file():
        raise ConfigError(f"{CONFIG_ENV}: config file {path} does not exist")
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc
    except ValueError as exc:  # TOML syntax errors and unparsable env JSON land here
        raise ConfigError(f"config: {exc}") from exc


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "settings"
        given = error.get("input")
        # A table or list may hold keys: only a scalar outside a key field is echoed.
        secret = "password" in key or "key" in key or isinstance(given, dict | list)
        shown = "" if secret else f" (got {given!r})"
        lines.append(f"{key}: {error['msg']}{shown}")
    return "; ".join(lines)


def masked_dump(settings: Settings) -> dict[str, Any]:
    """The effective settings as plain data, secrets shown as '***'."""
    data = settings.model_dump(mode="json")
    data["server"]["api_keys"] = ["***" for _ in settings.server.api_keys]
    for client in data["admission"]["clients"]:
        client["key"] = client["key"] and "***"
    return data
