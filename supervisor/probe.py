"""Questions the supervisor asks the worker over HTTP: alive, serving, able to decode."""

from __future__ import annotations

import httpx
import structlog

log = structlog.get_logger("supervisor.probe")


class HttpProber:
    """Probes one worker base URL; every call has its own timeout and never raises."""

    def __init__(self, base_url: str, model_name: str, timeout_s: float) -> None:
        self._model = model_name
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=4),
            trust_env=False,
        )

    async def healthy(self) -> bool:
        """vLLM's /health is 200 (a hung engine can still pass this: the canary catches that)."""
        return await self._ok("GET", "/health")

    async def serving(self) -> bool:
        """/health and /v1/models both answer: the model is loaded and the API routes are up."""
        return await self.healthy() and await self._ok("GET", "/v1/models")

    async def canary(self, timeout_s: float) -> bool:
        """A one-token completion: proof that the engine decodes, not only that HTTP answers."""
        body = {"model": self._model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        return await self._ok("POST", "/v1/completions", json=body, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _ok(self, method: str, path: str, **kwargs: object) -> bool:
        try:
            response = await self._client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            log.debug("probe.failed", path=path, error=type(exc).__name__)
            return False
        return response.status_code == 200
