"""A real vllm-router in front of the boxes, with the flags deploy/fleet/vllm-router.service
gives it (health on /readyz, retries, circuit breaker)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from load.kit.net import free_port

CB_OPEN_S = 10  # a box that failed requests is skipped this long (ROUTER_CB_OPEN_S)
# install.sh --dev puts it in the checkout's .router-venv; CHAT_APPLIANCE_ROUTER names another.
DEFAULT_BIN = os.environ.get("CHAT_APPLIANCE_ROUTER", str(
    Path(__file__).resolve().parents[2] / ".router-venv" / "bin" / "vllm-router"))
# deploy/fleet/router.env's values, but the circuit breaker: it opens on a box's failures.
FLAGS = ["--health-check-endpoint", "/readyz", "--health-check-interval-secs", "1",
         "--health-check-timeout-secs", "3", "--health-failure-threshold", "1",
         "--health-success-threshold", "2", "--worker-startup-check-interval", "1",
         "--retry-max-retries", "5",
         "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "2000",
         "--cb-failure-threshold", "5", "--cb-success-threshold", "2",
         "--cb-timeout-duration-secs", str(CB_OPEN_S), "--cb-window-duration-secs", "60",
         "--request-timeout-secs", "600", "--log-level", "info"]


class Router:
    def __init__(self, binary: str, urls: list[str], policy: str, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy = policy
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls,
             "--policy", policy, "--prometheus-port", str(free_port()), *FLAGS],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ | (env or {}))

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Its /health answers once every box was healthy at its start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm-router exited {self.proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("vllm-router never became ready")

    def healthy(self) -> dict[str, bool]:
        """Each box's URL and whether the router sends it requests now."""
        workers = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        return {w["url"]: bool(w["is_healthy"]) for w in workers}

    def wait_until(self, url: str, healthy: bool, timeout_s: float = 600) -> float:
        started = time.monotonic()
        while self.healthy().get(url) is not healthy:
            assert time.monotonic() - started < timeout_s, f"{url} never became {healthy}"
            time.sleep(0.1)
        return time.monotonic() - started

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def running_router(binary: str, urls: list[str], policy: str, log: Path,
                   env: dict[str, str] | None = None) -> Iterator[Router]:
    """`env`: SSL_CERT_FILE, the boxes' certificates, where they serve HTTPS."""
    router = Router(binary, urls, policy, log, env)
    try:
        router.wait_ready()
        yield router
    finally:
        router.stop()
