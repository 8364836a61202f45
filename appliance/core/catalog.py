"""The model catalog: the models a client may name as `model`, each with the engine settings of
its own worker. `[models.<name>]` tables in the configuration hold it; without any, the one
model of `[engine]` is the catalog, as before there was one.

A model's table says only what differs for it: what it leaves out comes from `[engine]`. Each
model has its own worker, on its own private socket (the default model's where `[engine]` puts
it; another's in `model-<name>` inside that directory) or, on TCP, its own port (the engine's
port plus its place in the catalog).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from appliance.core.sections import EngineSettings, PolicySettings

Tree = TypeVar("Tree", bound=BaseModel)  # appliance.core.settings.Settings, which imports this

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # it names a directory too


class ModelSettings(BaseModel):
    """One model of the catalog: its directory, the names clients send for it, and the engine
    settings that differ from `[engine]` for it (None: as `[engine]` says)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    aliases: list[str] = Field(default_factory=list)
    default: bool = False  # the model a request that names none gets
    dtype: str | None = None
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    kv_budget_sequences: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    gpu_memory_max_share: float | None = Field(None, gt=0, le=1)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: Path | None = None
    trust_remote_code: bool | None = None
    extra_args: list[str] = Field(default_factory=list)  # after [engine]'s
    env: dict[str, str] = Field(default_factory=dict)  # over [engine]'s
    # Its media guard, as policy.multimodal says for every model (None: that setting).
    multimodal: Literal["auto", "on", "off"] | None = None
    # Unloaded (its worker stopped, its memory given back) after this long without a request;
    # the next request for it loads it again. None: never for being idle.
    keep_alive_s: float | None = Field(None, gt=0)
    # Always loaded, never unloaded, and /health is 503 while it is not ready. None: the
    # default model is pinned, the others are not.
    pinned: bool | None = None
    # Sequences this model's requests may hold at once; beyond it they wait in the model's own
    # queue (admission.queue_max, queue_wait_s), never holding up another model's. None: only
    # policy.max_inflight and the clients' limits, which hold as well.
    max_inflight: int | None = Field(None, ge=1)
    # On a CUDA GPU, residency puts this model's worker to sleep (vLLM's sleep mode, level 1:
    # weights kept in host memory) instead of stopping it, and wakes it instead of starting one.
    # Refused at start-up on the CPU, where vLLM has no sleep mode.
    sleep: bool = False


class ResidencySettings(BaseModel):
    """How many models are loaded at once, and how a request for one that is not waits."""

    model_config = ConfigDict(extra="forbid")

    # Models loaded at once; a request for another waits while the least recently used idle
    # model is unloaded. None: no limit (each model loaded at start; keep_alive_s still unloads).
    max_loaded: int | None = Field(None, ge=1)
    # The memory the loaded models' reservations share (bytes; supervisor.engine.planner).
    # None: the GPU's total memory, or on the CPU the host memory available at start.
    memory_bytes: int | None = Field(None, ge=1)
    queue_max: int = Field(16, ge=0)  # requests waiting per model for its load; then 429
    load_wait_s: float = Field(120.0, gt=0)  # a request waits this long for its load; then 503
    # A model loaded this recently is not unloaded for another (no thrash between two).
    min_resident_s: float = Field(10.0, ge=0)
    idle_check_s: float = Field(1.0, gt=0)  # how often keep_alive_s is checked
    # A sleep or a wake-up (models.<name>.sleep) not answered this soon fails: the worker is
    # stopped instead, or stopped and started afresh.
    sleep_timeout_s: float = Field(60.0, gt=0)


# The per-model fields that replace [engine]'s field of the same name where they are set.
_OVERRIDES = ("dtype", "max_model_len", "max_num_seqs", "kv_cache_memory_bytes",
              "kv_budget_sequences", "gpu_memory_utilization", "gpu_memory_max_share",
              "tool_call_parser", "reasoning_parser", "chat_template", "trust_remote_code")


def check_catalog(models: dict[str, ModelSettings], engine: EngineSettings,
                  residency: ResidencySettings | None = None) -> None:
    """Raise ValueError, naming the clash, where the catalog is not one name per model: two
    models claim a name, or more than one is the default; or more models are pinned than may
    be loaded at once; or a model asks for sleep mode off a CUDA GPU."""
    claimed: dict[str, str] = {}
    for name, model in models.items():
        if not re.match(MODEL_NAME_PATTERN, name):
            raise ValueError(f"models.{name}: a model's name is letters, digits, '.', '_' and "
                             "'-', at most 64, starting with a letter or digit")
        for served in (name, *model.aliases):
            if not served.strip():
                raise ValueError(f"models.{name}: an alias must not be empty")
            if served in claimed and claimed[served] != name:
                raise ValueError(f"models.{name} and models.{claimed[served]} both claim the "
                                 f"name {served!r}")
            claimed[served] = name
    defaults = [name for name, model in models.items() if model.default]
    if len(defaults) > 1:
        raise ValueError(f"only one model can be the default: {', '.join(defaults)} say so")
    most = residency.max_loaded if residency is not None else None
    if most is not None and models:
        first = next((name for name, model in models.items() if model.default), next(iter(models)))
        pinned = [name for name, model in models.items()
                  if model.pinned or (model.pinned is None and name == first)]
        if len(pinned) > most:
            raise ValueError(f"residency.max_loaded is {most}, but {len(pinned)} models are "
                             f"pinned ({', '.join(pinned)}): pinned models are always loaded")
    sleepers = [name for name, model in models.items() if model.sleep]
    if sleepers and engine.resolved_device() != "cuda":
        raise ValueError(f"models.{sleepers[0]}.sleep = true needs a CUDA GPU (vLLM's sleep "
                         f"mode), but the engine runs on the {engine.resolved_device()}: "
                         "remove the setting")
    if not models and engine.model_name in engine.served_model_aliases:
        raise ValueError("engine.served_model_aliases repeats the model's own name")


@dataclass(frozen=True)
class CatalogEntry:
    """One model as the supervisor starts it and the API routes to it."""

    name: str
    aliases: tuple[str, ...]
    default: bool
    pinned: bool
    keep_alive_s: float | None
    engine: EngineSettings  # its worker's settings: [engine] with the model's own over them
    multimodal: str | None = None  # its own policy.multimodal; None: [policy]'s
    max_inflight: int | None = None  # its own admission cap (appliance.admission.slots)
    sleep: bool = False  # residency puts its worker to sleep instead of stopping it

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def settings(self, settings: Tree) -> Tree:
        """The whole settings tree as this model's worker and policy read it."""
        update: dict[str, Any] = {"engine": self.engine}
        if self.multimodal is not None:
            policy: PolicySettings = settings.policy  # type: ignore[attr-defined]
            update["policy"] = policy.model_copy(update={"multimodal": self.multimodal})
        return settings.model_copy(update=update)


class Catalog:
    """The models in the order of the configuration, the default first."""

    def __init__(self, entries: list[CatalogEntry]) -> None:
        if not entries or not entries[0].default:
            raise ValueError("a catalog holds at least one model, its default first")
        self.entries = entries
        self._by_name = {served: entry for entry in entries for served in entry.served_names}

    @classmethod
    def from_settings(cls, settings: Any) -> Catalog:
        """From an appliance.core.settings.Settings: its [models.<name>] tables, else [engine]."""
        engine: EngineSettings = settings.engine
        if not settings.models:
            return cls([CatalogEntry(engine.model_name, tuple(engine.served_model_aliases),
                                     default=True, pinned=True, keep_alive_s=None,
                                     engine=engine)])
        tables = list(settings.models.items())
        first = next((i for i, (_, model) in enumerate(tables) if model.default), 0)
        tables.insert(0, tables.pop(first))
        return cls([_entry(engine, name, model, index)
                    for index, (name, model) in enumerate(tables)])

    @property
    def default(self) -> CatalogEntry:
        return self.entries[0]

    def find(self, served: str) -> CatalogEntry | None:
        """The model a client's `model` names (its name or an alias), or None."""
        return self._by_name.get(served)

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _entry(engine: EngineSettings, name: str, model: ModelSettings, index: int) -> CatalogEntry:
    update: dict[str, Any] = {field: getattr(model, field) for field in _OVERRIDES
                              if getattr(model, field) is not None}
    update |= {
        "model": model.path,
        "served_model_name": name,
        "served_model_aliases": list(model.aliases),
        "extra_args": [*engine.extra_args, *model.extra_args],
        "env": {**engine.env, **model.env},
    }
    if index > 0:  # the default keeps [engine]'s socket and port: what an operator set up
        update["socket_dir"] = engine.resolved_socket_dir() / f"model-{name}"
        update["port"] = engine.port + index
    pinned = model.pinned if model.pinned is not None else index == 0
    return CatalogEntry(name, tuple(model.aliases), default=index == 0,
                        pinned=pinned, keep_alive_s=model.keep_alive_s,
                        engine=engine.model_copy(update=update), multimodal=model.multimodal,
                        max_inflight=model.max_inflight, sleep=model.sleep)
