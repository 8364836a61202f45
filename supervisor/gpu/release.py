"""After a stop: wait until the old worker's GPU memory is free, never blocking the event loop.

NVML numbers processes as the host does, which is not always what the supervisor sees, and
does not always list them, so what "released" means depends on the box, decided at each look:
- NVML lists processes, same PID namespace: none of the old worker's PIDs holds memory;
- NVML lists processes, the supervisor in a container without the host's PID namespace: the
  worker's PIDs mean nothing to NVML, so none of the processes that appeared since the GPU was
  last idle (the baseline) may still hold memory;
- NVML will not list processes (MIG as a user other than root, an old driver): the GPU's used
  memory is back within `release_slack_mib` of what it was when the supervisor started.
Every NVML call runs in NVML's own thread with the time left as its limit: a sick GPU whose calls
block for seconds freezes neither the API, /livez nor the watchdog ping, and a call that never
returns holds that one thread, not the event loop's shared pool (calls queued behind it and
given up are cancelled before they run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")
# The kernel's inode number of the initial PID namespace (PROC_PID_INIT_INO).
HOST_PID_NAMESPACE_INODE = 0xEFFFFFFC
MIB = 1024 * 1024
_NVML_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")


class ProcessLister(Protocol):
    def pids_using_memory(self) -> set[int] | None: ...

    def memory_used_bytes(self) -> int | None: ...


def in_host_pid_namespace(path: str = "/proc/self/ns/pid") -> bool:
    try:
        return os.stat(path).st_ino == HOST_PID_NAMESPACE_INODE
    except OSError:  # no /proc: assume the host's, as NVML does
        return True


class NvmlTimeout(Exception):
    """An NVML call did not answer in the time it had; it runs on in its thread, alone."""


async def off_loop(call: Callable[[], T], timeout_s: float) -> T:
    """`call()` in NVML's thread, so the event loop turns while NVML blocks."""
    running = asyncio.get_running_loop().run_in_executor(_NVML_THREAD, call)
    try:
        return await asyncio.wait_for(running, max(timeout_s, 0.001))
    except TimeoutError:
        name = getattr(call, "__name__", str(call))
        log.warning("gpu.nvml_call_slow", call=name, waited_s=round(timeout_s, 3))
        raise NvmlTimeout(name) from None


class ReleaseWait:
    """Knows what the GPU held while no worker ran (the baseline) and waits for a release."""

    def __init__(self, lister: ProcessLister, slack_mib: int, *,
                 host_pids: bool | None = None,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = 0.25) -> None:
        self._lister = lister
        self._slack = slack_mib * MIB
        self._host_pids = in_host_pid_namespace() if host_pids is None else host_pids
        self._sleep = sleep
        self._clock = clock
        self._interval = interval_s
        self._idle_pids: set[int] = set()
        self._idle_used: int | None = None

    async def note_idle(self, timeout_s: float) -> None:
        """No worker runs now: what the GPU holds is someone else's (a desktop, another job).
        The used memory is taken once, at start: taken after each release it would creep up
        by the slack every restart."""
        try:
            pids = await off_loop(self._lister.pids_using_memory, timeout_s)
            if self._idle_used is None:
                self._idle_used = await off_loop(self._lister.memory_used_bytes, timeout_s)
        except NvmlTimeout:
            return
        self._idle_pids = pids or set()
        log.info("gpu.idle_baseline", pids=sorted(self._idle_pids), used_bytes=self._idle_used,
                 host_pid_namespace=self._host_pids)

    async def wait(self, pids: set[int], timeout_s: float) -> bool:
        """Until the old worker's memory is free; False on timeout (logged)."""
        deadline = self._clock() + timeout_s
        while True:
            try:
                holding = await self._holding(pids, deadline)
            except NvmlTimeout:
                holding = "unknown: NVML did not answer"
            if not holding:
                await self.note_idle(max(deadline - self._clock(), self._interval))
                return True
            remaining = deadline - self._clock()
            if remaining <= 0:
                log.warning("gpu.memory_not_released", holding=holding, timeout_s=timeout_s)
                return False
            await self._sleep(min(self._interval, remaining))

    async def _holding(self, pids: set[int], deadline: float) -> str:
        """What still holds the memory, in words; '' once released."""
        listed = await off_loop(self._lister.pids_using_memory, deadline - self._clock())
        if listed is not None:
            holders = pids & listed if self._host_pids else listed - self._idle_pids
            return f"pids {sorted(holders)}" if holders else ""
        used = await off_loop(self._lister.memory_used_bytes, deadline - self._clock())
        if used is None or self._idle_used is None:  # nothing to compare: do not hold it up
            return ""
        over = used - self._idle_used - self._slack
        return f"{over // MIB} MiB above the idle baseline" if over > 0 else ""
