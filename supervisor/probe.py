"""Questions the supervisor asks the worker over HTTP, on a thread of their own.

The probes share no fate with the API: they run on their own small thread pool with their own
connections, so a stalled event loop (a huge body being parsed, a flood of clients) can delay
when a verdict is read but never makes a healthy worker look dead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import httpx
import structlog

from supervisor.engine_stats import EngineStats, parse_engine_stats

log = structlog.get_logger("supervisor.probe")


class HttpProber:
    """Probes one worker base URL; every call has its own timeout and never raises."""

    def __init__(self, base_url: str, model_name: str, timeout_s: float) -> None:
        self._model = model_name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                           thread_name_prefix="probe")
        self._client = httpx.Client(base_url=base_url, timeout=httpx.Timeout(timeout_s),
                                    limits=httpx.Limits(max_connections=2), trust_env=False)

    async def healthy(self) -> bool:
        """vLLM's /health is 200 (a hung engine can still pass this: progress catches that)."""
        return await self._ok("GET", "/health")

    async def serving(self) -> bool:
        """/health and /v1/models both answer: the model is loaded and the API routes are up."""
        return await self.healthy() and await self._ok("GET", "/v1/models")

    async def canary(self, timeout_s: float) -> bool:
        """A one-token completion: proof that the engine decodes, not only that HTTP answers."""
        body = {"model": self._model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        return await self._ok("POST", "/v1/completions", json=body, timeout=timeout_s)

    async def engine_stats(self) -> EngineStats | None:
        """The worker's /metrics, read for progress; None if it did not answer."""
        response = await self._request("GET", "/metrics")
        if response is None or response.status_code != 200:
            return None
        return parse_engine_stats(response.text)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._client.close)
        self._pool.shutdown(wait=False)

    async def _ok(self, method: str, path: str, **kwargs: Any) -> bool:
        response = await self._request(method, path, **kwargs)
        return response is not None and response.status_code == 200

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        def call() -> httpx.Response | None:
            try:
                response = self._client.request(method, path, **kwargs)
                response.read()
                return response
            except httpx.HTTPError as exc:
                log.debug("probe.failed", path=path, error=type(exc).__name__)
                return None

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)
