"""Chaos during a load run: kill -9 or SIGSTOP the worker /health names (or a process of its
tree, such as its EngineCore), then watch a new worker become ready."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import psutil

ACTIONS = (("kill", signal.SIGKILL), ("hang", signal.SIGSTOP))


@dataclass
class Strike:
    """One signal sent to one worker pid, and when (if ever) a new worker was ready."""

    action: str
    pid: int  # the process signalled
    at_s: float
    worker: int  # the worker /health named then: recovered once another one is ready
    recovered_s: float | None = None
    new_pid: int | None = None
    resumed: bool = False  # a hung pid still stopped at the end was sent SIGCONT by us

    def line(self) -> str:
        head = f"{self.action} (SIG{'KILL' if self.action == 'kill' else 'STOP'}) pid {self.pid}"
        if self.recovered_s is None:
            tail = "NOT recovered" + ("; we sent it SIGCONT" if self.resumed else "")
        else:
            tail = (f"recovered after {self.recovered_s - self.at_s:.1f} s "
                    f"(new pid {self.new_pid})")
        return f"t={self.at_s:6.1f} s  {head}: {tail}"


class Chaos:
    """Alternates kill and hang, one at a time: the next strike comes `interval_s` after the
    last recovery, so that each strike hits a warm, loaded engine."""

    def __init__(self, url: str, interval_s: float, headers: dict[str, str],
                 victim: Callable[[int], int | None] = lambda worker: worker) -> None:
        self._client = httpx.Client(base_url=url, headers=headers, timeout=3.0, trust_env=False)
        self._interval_s = interval_s
        self._victim = victim  # the worker's pid -> the pid to signal (None: not now)
        self._t0 = time.monotonic()
        self.strikes: list[Strike] = []

    def begin(self) -> None:
        """Start the clock: strike times are seconds since the load began."""
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def close(self) -> None:
        self._client.close()

    def ready_pid(self) -> int | None:
        """The worker pid while the appliance says ready; None otherwise (or unreachable)."""
        try:
            response = self._client.get("/health")
        except httpx.HTTPError:
            return None
        pid = response.json().get("pid") if response.status_code == 200 else None
        return int(pid) if isinstance(pid, int) else None

    def tick(self, until_s: float) -> None:
        """Called often: notes a recovery, or strikes when one is due before `until_s`."""
        elapsed_s = self.elapsed()
        last = self.strikes[-1] if self.strikes else None
        if last is not None and last.recovered_s is None:
            self._check_recovery(last, elapsed_s)
            return
        healthy_since = last.recovered_s if last is not None and last.recovered_s else 0.0
        due = healthy_since + self._interval_s
        if due <= elapsed_s < until_s:
            self._strike(elapsed_s)

    def settle(self) -> bool:
        """After the run: True once every strike has recovered (and there was one)."""
        for strike in self.strikes:
            if strike.recovered_s is None:
                self._check_recovery(strike, self.elapsed())
        return bool(self.strikes) and all(s.recovered_s is not None for s in self.strikes)

    def release_hung(self) -> None:
        """A pid we stopped and the supervisor never replaced gets SIGCONT, and only that pid."""
        for strike in self.strikes:
            if strike.action == "hang" and strike.recovered_s is None and _stopped(strike.pid):
                os.kill(strike.pid, signal.SIGCONT)
                strike.resumed = True

    def _strike(self, elapsed_s: float) -> None:
        worker = self.ready_pid()
        pid = None if worker is None else self._victim(worker)
        if worker is None or pid is None or pid == os.getpid() or not psutil.pid_exists(pid):
            return  # not ready (still recovering from something else): try on the next tick
        action, sig = ACTIONS[len(self.strikes) % len(ACTIONS)]
        os.kill(pid, sig)
        self.strikes.append(Strike(action, pid, elapsed_s, worker))
        print(f"chaos: t={elapsed_s:.1f} s {action} pid {pid}", flush=True)

    def _check_recovery(self, strike: Strike, elapsed_s: float) -> None:
        pid = self.ready_pid()
        if pid is not None and pid != strike.worker:
            strike.recovered_s, strike.new_pid = elapsed_s, pid
            print(f"chaos: t={elapsed_s:.1f} s ready again, pid {pid}", flush=True)


def _stopped(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(psutil.Process(pid).status() == psutil.STATUS_STOPPED)
    return False
