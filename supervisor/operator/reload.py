"""Reload: the clients table and the TLS certificate again from the configuration, without a
restart. One action for every way an operator asks (`chat-appliance reload` and systemctl
reload through the control socket, SIGHUP).

All or nothing: a file with an error, or a certificate that does not load, keeps everything in
force and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from appliance.core.settings import ConfigError, Settings, load_settings
from supervisor.operator.control import ControlRefused
from supervisor.operator.tls import ServerTls


class ClientTable(Protocol):
    @property
    def names(self) -> list[str]: ...

    @property
    def keys(self) -> int: ...


class Clients(Protocol):
    """The API's clients table in force (appliance.admission.clients.Roster)."""

    generation: int

    def reload(self, load: Callable[[], Settings]) -> ClientTable: ...


class Reloader:
    def __init__(self, clients: Clients, tls: ServerTls | None,
                 load: Callable[[], Settings] = load_settings) -> None:
        self._clients, self._tls, self._load = clients, tls, load

    def __call__(self) -> dict[str, Any]:
        """The control socket's `reload`: what is now in force, or ControlRefused."""
        loaded: list[Settings] = []

        def load_checked() -> Settings:
            settings = self._load()
            if self._tls is not None:
                self._tls.check(settings.server)
            loaded.append(settings)
            return settings

        try:
            table = self._clients.reload(load_checked)  # logs clients.reload_failed itself
        except ConfigError as exc:
            raise ControlRefused(f"configuration not reloaded, what is in force stays: {exc}",
                                 "bad_configuration") from exc
        answer: dict[str, Any] = {"clients": table.names, "keys": table.keys,
                                  "generation": self._clients.generation}
        if self._tls is not None:
            answer["tls_fingerprint"] = self._tls.rotate(loaded[0].server)
        return answer

    def on_signal(self) -> None:
        """SIGHUP: the same reload, with no one to answer (the refusal is already logged)."""
        try:
            self()
        except ControlRefused:
            return
