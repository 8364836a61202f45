"""What the API may know of the engine: a small read-only view the supervisor implements."""

from __future__ import annotations

import asyncio
import enum
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


class EngineView(Protocol):
    """The engine as the API sees it; implemented by supervisor.manager.EngineManager."""

    @property
    def state(self) -> EngineState: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    def retry_after_s(self) -> int:
        """How long a client should wait before trying again while the engine is not ready."""
        ...

    def lost(self) -> asyncio.Event:
        """Set when the current worker stops serving (crash, hang, stop); a new one per worker."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Health detail: state, pid, uptime, restarts, last exit cause, GPU summary."""
        ...

    def note_request(self, delta: int) -> None:
        """A request to the worker started (+1) or ended (-1); the stall watch needs the count."""
        ...

    def note_progress(self) -> None:
        """Bytes arrived from the worker; a stall is no bytes while requests are in flight."""
        ...
