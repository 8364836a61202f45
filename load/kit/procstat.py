"""Resource readings of a process watched by pid: resident memory, open file descriptors, and
CPU time to the nanosecond, the whole process's and each thread's."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Self

import psutil

MIB = 1024 * 1024
_CPUCLOCK_SCHED = 2  # the kernel's CPU clock of a process: its threads' summed run time


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    fds: int

    @property
    def rss_mib(self) -> float:
        return self.rss_bytes / MIB

    def __str__(self) -> str:
        return f"{self.rss_mib:.0f} MiB, {self.fds} fds"


def usage(pid: int) -> Usage:
    process = psutil.Process(pid)
    return Usage(process.memory_info().rss, process.num_fds())


def cpu_ns(pid: int) -> int:
    """CPU time the process has used, in all its threads, ended ones too, in nanoseconds; 0 once
    it is gone. Read from its CPU clock, which Linux lets any process read (clock_gettime with
    the clock id glibc's clock_getcpuclockid makes): /proc's times come in 10 ms ticks, a tenth
    of what the appliance spends in a benchmark's phase."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        return 0


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each live thread's CPU time in nanoseconds, by thread id (its schedstat's first field)."""
    found: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as handle:
                found[int(tid)] = int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return found


class Sampler:
    """Calls `sample()` every `interval_s` in a thread of its own while a `with` block runs."""

    def __init__(self, interval_s: float, join_s: float = 5.0) -> None:
        self._interval_s = interval_s
        self._join_s = join_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(self._join_s)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class PeakSampler(Sampler):
    """Samples a process while a `with` block runs, and once at its end; `peak` is the
    highest seen."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        super().__init__(interval_s)
        self._pid = pid
        self.peak = usage(pid)

    def __exit__(self, *_: object) -> None:
        super().__exit__()
        self.sample()

    def sample(self) -> None:
        try:
            now = usage(self._pid)
        except psutil.Error:
            return
        self.peak = Usage(max(self.peak.rss_bytes, now.rss_bytes), max(self.peak.fds, now.fds))
