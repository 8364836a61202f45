"""Why a worker stopped serving: one vocabulary, interpreted in one place."""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Phase = Literal["boot", "running"]


class ExitReason(enum.StrEnum):
    EXITED = "exited"  # the process ended on its own (crash, OOM kill, operator)
    UNHEALTHY = "unhealthy"  # K consecutive failed /health probes
    HUNG = "hung"  # no progress while busy, or an idle canary that never answered
    GPU_APP_ERROR = "gpu_app_error"  # an application Xid: the GPU is fine, restart the worker
    GPU_FATAL = "gpu_fatal"  # lost, or needs a reset or reboot (named in detail): no restart
    STARTUP_TIMEOUT = "startup_timeout"
    SPAWN_FAILED = "spawn_failed"
    STOPPED = "stopped"  # the supervisor asked for it
    UNLOADED = "unloaded"  # residency gave its memory back (idle, or another model's turn)

    @property
    def restartable(self) -> bool:
        """Whether starting a new worker may cure it."""
        return self not in (ExitReason.GPU_FATAL, ExitReason.STOPPED, ExitReason.UNLOADED)

    @property
    def asked(self) -> bool:
        """The supervisor ended the worker on purpose: not a fault (no bundle, no restart)."""
        return self in (ExitReason.STOPPED, ExitReason.UNLOADED)


@dataclass(frozen=True)
class ExitCause:
    """Why a worker stopped serving; `phase` tells a boot failure from a crash after ready.

    `restart` carries the durations of the recovery that followed (detect → stopped →
    spawned → ready), filled in as each step completes.
    """

    phase: Phase
    reason: ExitReason
    detail: str
    at: float = field(default_factory=time.time)  # wall clock, for /health
    restart: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"reason": self.reason.value}


def process_exit(returncode: int | None, phase: Phase) -> ExitCause:
    """The cause for a worker process that ended with `returncode`."""
    how = describe_exit(returncode)
    detail = f"never became ready: {how}" if phase == "boot" else f"crashed after ready: {how}"
    return ExitCause(phase, ExitReason.EXITED, detail)


def describe_exit(returncode: int | None) -> str:
    """'exit 1', 'SIGKILL (out of memory?)', 'running' for a process that had not exited."""
    if returncode is None:
        return "running"
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    hint = {
        signal.SIGKILL: " (killed: out of memory, or an operator?)",
        signal.SIGSEGV: " (crashed in native code)",
        signal.SIGABRT: " (aborted)",
    }.get(sig, "")
    return f"{sig.name}{hint}"
