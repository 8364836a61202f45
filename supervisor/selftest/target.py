"""The appliance under test: its API (as a client sees it) and, past it, its worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from supervisor.engine.stats import EngineStats, parse_engine_stats
from supervisor.engine.worker import session_members
from supervisor.selftest.report import CheckFailed

POLL_S = 0.1


@dataclass
class Target:
    url: str
    headers: dict[str, str]
    model: str
    max_n: int
    boot_timeout_s: float  # a worker's start, from a crash to ready
    client: httpx.Client
    # Why the appliance itself is gone (an instance of the self-test's own that exited), or None.
    gone: Callable[[], str | None] = field(default=lambda: None)

    @classmethod
    def connect(cls, url: str, api_key: str | None, model: str, max_n: int,
                boot_timeout_s: float, verify: Any = True) -> Target:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=url, headers=headers, timeout=120, trust_env=False,
                              verify=verify)
        return cls(url, headers, model, max_n, boot_timeout_s, client)

    def health(self) -> tuple[int, dict[str, Any]]:
        response = self.client.get("/health", timeout=5)
        return response.status_code, dict(response.json())

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return self.client.post(path, json={"model": self.model} | body, **kwargs)

    def wait_ready(self, other_than: int | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
        """/health's detail once it is 200 with a worker other than `other_than`."""
        deadline = time.monotonic() + (timeout_s or self.boot_timeout_s)
        while time.monotonic() < deadline:
            if (why := self.gone()) is not None:
                raise CheckFailed(why)
            try:
                code, detail = self.health()
            except (httpx.HTTPError, ValueError):
                code, detail = 0, {}
            if code == 200 and detail.get("pid") not in (None, other_than):
                return detail
            if detail.get("state") == "failed":  # a crash loop: no worker comes for a while
                last = detail.get("last_exit") or {}
                raise CheckFailed(f"the engine failed: {last.get('detail') or 'crash loop'}")
            time.sleep(POLL_S)
        raise CheckFailed(f"not ready again within {timeout_s or self.boot_timeout_s:.0f} s")

    def wait_not_ready(self, timeout_s: float) -> float:
        """Seconds until /health leaves 200."""
        started = time.monotonic()
        while self.health()[0] == 200:
            if time.monotonic() - started > timeout_s:
                raise CheckFailed(f"still ready {timeout_s:.0f} s after the fault")
            time.sleep(POLL_S)
        return time.monotonic() - started

    def worker_pid(self) -> int:
        code, detail = self.health()
        if code != 200 or not isinstance(detail.get("pid"), int):
            raise CheckFailed(f"the engine is not ready (/health {code}, {detail.get('state')})")
        return int(detail["pid"])


def worker_tree(pid: int) -> list[psutil.Process]:
    """The worker's processes: it leads its own session (EngineCore, the resource tracker)."""
    return session_members(pid)


def engine_core(pid: int) -> psutil.Process:
    for proc in worker_tree(pid):
        if proc.pid != pid and "EngineCore" in proc.name() + " ".join(proc.cmdline()):
            return proc
    raise CheckFailed(f"no EngineCore process in worker {pid}'s session")


def worker_stats(pid: int) -> EngineStats:
    """The worker's own counters, asked where it listens (a socket in a directory only the
    service user may enter: root or that user only). vLLM writes its process title over its
    command line, so the address is read from the process's open sockets."""
    transport, base = _worker_address(psutil.Process(pid))
    with httpx.Client(transport=transport, base_url=base, timeout=5, trust_env=False) as client:
        response = client.get("/metrics")
        response.raise_for_status()
        return parse_engine_stats(response.text)


def _worker_address(proc: psutil.Process) -> tuple[httpx.HTTPTransport, str]:
    for unix in proc.net_connections("unix"):
        if isinstance(unix.laddr, str) and unix.laddr.endswith(".sock"):
            return httpx.HTTPTransport(uds=unix.laddr), "http://worker"
    for inet in proc.net_connections("inet"):
        if inet.status == psutil.CONN_LISTEN:
            return httpx.HTTPTransport(), f"http://127.0.0.1:{inet.laddr[1]}"
    raise CheckFailed(f"worker {proc.pid} listens nowhere this user can see")
