"""What a worker's processes are doing, read from /proc: their CPU time so far, their threads
doing work, and whether they are stopped (what the progress watch and the stillness check judge
a silent engine or server by)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from supervisor.engine.worker import Worker, session_members

_MEMBERS_REFRESH_S = 10.0


@dataclass(frozen=True)
class Activity:
    cpu_s: float  # CPU seconds the engine processes used so far
    runnable: int  # their threads running or waiting for a core (or in uninterruptible I/O)
    stopped: bool = False  # every thread stopped (SIGSTOP, a tracer): none runs until continued


class EngineActivity:
    """What a worker's engine processes (its tree minus its server, or the server alone if it
    has no child) are doing, from /proc."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leader: int | None = None
        self._members: list[psutil.Process] = []
        self._refreshed = float("-inf")

    def __call__(self, worker: Worker, threads: bool = True) -> Activity | None:
        """None when the set of processes changed since the last call (deltas would lie).
        Without `threads` the thread states are not read (the costly part: a file per thread)
        and `runnable` is 0."""
        changed = False
        alone = [p.pid for p in self._members] == [worker.pid]  # children may come later
        if worker.pid != self._leader or alone \
                or self._clock() - self._refreshed >= _MEMBERS_REFRESH_S:
            tree = session_members(worker.pid)
            # The engine runs in the server's children (vLLM's EngineCore); a worker with no
            # child runs its engine in the server process itself.
            members = [p for p in tree if p.pid != worker.pid] or tree
            changed = {p.pid for p in members} != {p.pid for p in self._members} \
                or worker.pid != self._leader
            self._leader, self._members, self._refreshed = worker.pid, members, self._clock()
        total, runnable = 0.0, 0
        for proc in self._members:
            cpu_s = cpu_seconds(proc.pid)
            if cpu_s is None:
                self._refreshed = float("-inf")  # one ended: rescan next time
                return None
            total += cpu_s
            if threads:
                runnable += runnable_threads(proc.pid)
        return None if changed else Activity(total, runnable)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_stat_files: dict[int, int] = {}  # pid -> its /proc/<pid>/stat, kept open
_STAT_FILES_KEPT = 32  # past it (workers come and go) every one is closed, and reopened as read


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process `pid` so far; None once it is gone.

    Read several times a second on the serving loop (each question to the worker, each
    progress reading), so from a kept descriptor: one pread and a split, where psutil opens,
    reads and parses the file into a named tuple each time (about ten times the cost). A kept
    descriptor names its process, not its pid: once that process is gone its reads fail, so a
    reused pid never lends another process's figures."""
    fd = _stat_files.get(pid)
    try:
        if fd is None:
            if len(_stat_files) >= _STAT_FILES_KEPT:
                _close_stat_files()
            fd = _stat_files[pid] = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        stat = os.pread(fd, 1024, 0)
    except OSError:
        _forget_stat_file(pid)
        return None
    # "pid (comm) state ...": the fields after the last ')' (comm may hold anything); utime
    # and stime are the stat's 14th and 15th fields, in clock ticks.
    fields = stat[stat.rfind(b")") + 2:].split(maxsplit=13)
    if len(fields) < 13:
        _forget_stat_file(pid)
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _forget_stat_file(pid: int) -> None:
    fd = _stat_files.pop(pid, None)
    if fd is not None:
        os.close(fd)


def _close_stat_files() -> None:
    for pid in list(_stat_files):
        _forget_stat_file(pid)


def runnable_threads(pid: int) -> int:
    """Threads of `pid` in state R (running or runnable) or D (in I/O): doing work."""
    return thread_states(pid)[0]


def thread_states(pid: int) -> tuple[int, bool]:
    """Threads of `pid` doing work (R, D), and whether every thread is stopped (T by a signal,
    t by a tracer): a process that cannot run until something continues it."""
    count, stopped, seen = 0, 0, 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # "tid (comm) S ...": the state follows the last ')', since comm may hold spaces.
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        count += state in (b"R", b"D")
        stopped += state in (b"T", b"t")
        seen += 1
    return count, seen > 0 and stopped == seen
