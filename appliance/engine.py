"""What the API may know of the engine: a small read-only view the supervisor implements."""

from __future__ import annotations

import enum
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

