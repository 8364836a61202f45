"""Who is calling: named clients and anonymous keys, recognised by key, replaced whole on reload.

A named client (settings `admission.clients`) has its own limits and priority; a plain
`server.api_keys` key, or any caller while no key is configured, is the anonymous client with
the defaults. A client's name (never its key) labels its log lines and metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from appliance.core.sections import ClientSettings
from appliance.core.settings import ConfigError, Settings
from appliance.policy.auth import digest, match_key

log = structlog.get_logger("appliance.clients")

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Client:
    """A caller as admission and the gate see it; None limits are no limit."""

    name: str = ANONYMOUS
    priority: int = 0  # lower is served first, as in vLLM
    max_inflight: int | None = None
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    routes: tuple[str, ...] | None = None  # path templates, a trailing * a prefix; None: all
    output_constraints: bool = True  # may send regexes, grammars, schemas, choices

    def may_use(self, route: str) -> bool:
        if self.routes is None:
            return True
        return any(route == allowed or (allowed.endswith("*") and route.startswith(allowed[:-1]))
                   for allowed in self.routes)


ANYONE = Client()  # anonymous, with the built-in defaults


def _named(entry: ClientSettings, default_priority: int) -> Client:
    return Client(
        name=entry.name,
        priority=default_priority if entry.priority is None else entry.priority,
        max_inflight=entry.max_inflight,
        tokens_per_minute=entry.tokens_per_minute,
        max_tokens=entry.max_tokens,
        routes=None if entry.routes is None else tuple(entry.routes),
        output_constraints=entry.output_constraints,
    )


class ClientTable:
    """Key digests to clients. No key configured at all: every caller is anonymous."""

    def __init__(self, keyed: Sequence[tuple[bytes, Client]], anonymous: Client) -> None:
        self._digests = [digest for digest, _ in keyed]
        self._clients = [client for _, client in keyed]
        self.anonymous = anonymous

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientTable:
        admission = settings.admission
        anonymous = Client(priority=admission.default_priority)
        keyed = [(digest(key.get_secret_value()), anonymous) for key in settings.server.api_keys]
        keyed += [(bytes.fromhex(entry.digest()), _named(entry, admission.default_priority))
                  for entry in admission.clients]
        return cls(keyed, anonymous)

    @property
    def names(self) -> list[str]:
        return sorted({client.name for client in self._clients})

    @property
    def keys(self) -> int:
        return len(self._digests)

    def identify(self, authorization: str | None, x_api_key: str | None = None) -> Client:
        """The client `Authorization: Bearer <key>` (or, where the route takes it, `x-api-key`)
        names; Unauthorized if none (keys set)."""
        if not self._digests:
            return self.anonymous
        return self._clients[match_key(authorization, self._digests, x_api_key=x_api_key)]


class Roster:
    """The client table in force. A reload swaps the whole table: a request identified under
    the old one keeps its Client (limits and all) to its end."""

    def __init__(self, table: ClientTable, *, engine_priority: bool = False) -> None:
        self.table = table
        self.generation = 1
        self._engine_priority = engine_priority

    @classmethod
    def from_settings(cls, settings: Settings) -> Roster:
        return cls(ClientTable.from_settings(settings),
                   engine_priority=settings.admission.engine_priority())

    def identify(self, authorization: str | None, x_api_key: str | None = None) -> Client:
        return self.table.identify(authorization, x_api_key)

    def reload(self, load: Callable[[], Settings]) -> ClientTable:
        """Read the settings again and put their clients in force; on a ConfigError the table
        in force stays, and the error is logged and raised."""
        try:
            settings = load()
        except ConfigError as exc:
            log.error("clients.reload_failed", error=str(exc), kept_generation=self.generation)
            raise
        table = ClientTable.from_settings(settings)
        self.table = table
        self.generation += 1
        log.info("clients.reloaded", clients=table.names, keys=table.keys,
                 generation=self.generation)
        if settings.admission.engine_priority() and not self._engine_priority:
            log.warning("clients.priority_needs_restart",
                        detail="the worker runs first-come-first-served until it restarts; "
                               "priorities order the admission queue meanwhile")
        return table
