"""NVML's verdict on the GPU: an application Xid restarts the worker, a lost GPU fails."""

from __future__ import annotations

from typing import Literal, Protocol

from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.worker import Worker


class GpuVerdicts(Protocol):
    async def check(self) -> tuple[Literal["none", "restart_worker", "fail"], str]: ...


class GpuHealthMonitor:
    name = "gpu"

    def __init__(self, gpu: GpuVerdicts) -> None:
        self._gpu = gpu

    def reset(self) -> None:
        return None

    async def check(self, worker: Worker) -> ExitCause | None:
        action, cause = await self._gpu.check()
        if action == "restart_worker":
            return ExitCause("running", ExitReason.GPU_APP_ERROR, cause)
        if action == "fail":
            return ExitCause("running", ExitReason.GPU_FATAL, cause)
        return None
