"""What the API may know of the engine: a small read-only view the supervisor implements."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from typing import Any, Protocol


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


class Pending(Protocol):
    """What the supervisor may learn of one request waiting on the worker (an
    appliance.outbound.Outbound)."""

    @property
    def target(self) -> str: ...

    @property
    def stream(self) -> bool: ...

    @property
    def client_name(self) -> str: ...

    def body(self) -> bytes | None: ...


class Waiting:
    """The appliance's own requests waiting on the worker: sent (or being fitted with the
    worker's /tokenize) and not yet answered in full. Work the engine owes, known here even when
    the worker's own gauges froze with it. The relay adds and discards each request (one dict
    insert and delete); the supervisor reads the count each second and describes the requests
    only when an engine dies."""

    def __init__(self) -> None:
        self._requests: dict[object, tuple[str, Pending]] = {}
        self._named: dict[object, str] = {}  # fingerprints fixed at each request's first send
        self.sent = 0  # requests added so far: a new one is work the engine has not seen

    def add(self, key: object, request_id: str, pending: Pending) -> None:
        self._requests[key] = (request_id, pending)
        self.sent += 1

    def discard(self, key: object) -> None:
        self._requests.pop(key, None)
        self._named.pop(key, None)

    def fingerprint(self, key: object, body: bytes | None) -> str:
        """The request's fingerprint, fixed by the first call (its first send, `body` as sent
        then): a request sent again with a changed body (a resumed stream) keeps its name."""
        named = self._named.get(key)
        if named is None:
            pending = self._requests[key][1]
            named = self._named[key] = fingerprint(pending.target, pending.client_name,
                                                   body or b"")
        return named

    def __len__(self) -> int:
        return len(self._requests)

    def describe(self, bodies: bool = False) -> list[dict[str, Any]]:
        """Each request's id, fingerprint (as fixed at its first send, or of its body now if it
        was not sent yet), route, client and size; its body only if asked."""
        found = []
        for key, (request_id, pending) in list(self._requests.items()):
            client, raw = pending.client_name, pending.body() or b""
            entry: dict[str, Any] = {
                "request_id": request_id, "route": pending.target, "client": client,
                "fingerprint": self._named.get(key) or fingerprint(pending.target, client, raw),
                "body_bytes": len(raw), "stream": pending.stream}
            if bodies:
                entry["body"] = raw.decode("utf-8", "replace")
            found.append(entry)
        return found


def fingerprint(route: str, client: str, body: bytes) -> str:
    """Names one request by route, client and body, without keeping the body."""
    digest = hashlib.sha256(route.encode() + b"\0" + client.encode() + b"\0" + body)
    return digest.hexdigest()[:16]


class EngineView(Protocol):
    """The engine as the API sees it; implemented by supervisor.engine.manager.EngineManager."""

    @property
    def state(self) -> EngineState: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def waiting(self) -> Waiting:
        """Where the relay counts its requests waiting on the worker."""
        ...

    def retry_after_s(self) -> int:
        """How long a client should wait before trying again while the engine is not ready."""
        ...

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once if the current worker stops serving (crash, hang, stop);
        returns the function that cancels the subscription."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Health detail: state, pid, uptime, restarts, last exit cause, GPU summary."""
        ...

