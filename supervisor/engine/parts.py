"""What the engine manager is given: its launcher, boot prober, GPU memory and forensics, as
the small protocols it calls them through (the real ones and the tests' fakes both fit)."""

from __future__ import annotations

from typing import Any, Protocol

from supervisor.engine.exits import ExitCause
from supervisor.engine.worker import Worker


class Launcher(Protocol):
    async def start(self) -> Worker: ...


class BootProber(Protocol):
    async def healthy(self) -> bool: ...

    async def serving(self) -> bool: ...

    async def canary(self, timeout_s: float) -> bool: ...


class GpuMemory(Protocol):
    def summary(self) -> dict[str, Any]: ...

    async def wait_released(self, pids: set[int], timeout_s: float) -> bool: ...

    async def settle(self) -> str | None: ...


class Forensics(Protocol):
    """Gathers a crash bundle at each death (supervisor.forensics.recorder.Recorder)."""

    last: str | None  # the newest bundle's name

    def lost(self) -> None: ...

    async def before_stop(self, worker: Worker, cause: ExitCause) -> None: ...

    def stopped(self, worker: Worker, cause: ExitCause, stopped_in_s: float) -> None: ...

    def recovered(self, cause: ExitCause) -> None: ...


__all__ = ["BootProber", "Forensics", "GpuMemory", "Launcher"]
