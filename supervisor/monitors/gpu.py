"""NVML's verdict on the GPU, during boot and after ready: a restart-class Xid restarts the
worker, a GPU that needs a reset or a reboot (or is lost) fails with the operator's action."""

from __future__ import annotations

from typing import Literal, Protocol

from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.worker import Worker


class GpuVerdicts(Protocol):
    def new_worker(self) -> None: ...

    async def check(self) -> tuple[Literal["none", "restart_worker", "fail"], str]: ...


class GpuHealthMonitor:
    name = "gpu"
    watches_boot = True  # a GPU fault during a boot is known at once, not at its timeout

    def __init__(self, gpu: GpuVerdicts) -> None:
        self._gpu = gpu

    def reset(self) -> None:
        """What the GPU still reports of the ended worker is drained before this one is judged."""
        self._gpu.new_worker()

    async def check(self, worker: Worker) -> ExitCause | None:
        action, cause = await self._gpu.check()
        if action == "restart_worker":
            return ExitCause("running", ExitReason.GPU_APP_ERROR, cause)
        if action == "fail":
            return ExitCause("running", ExitReason.GPU_FATAL, cause)
        return None
