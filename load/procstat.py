"""Resource readings of a process watched by pid: resident memory and open file descriptors."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Self

import psutil

MIB = 1024 * 1024


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
