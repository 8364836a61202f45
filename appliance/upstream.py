"""The one HTTP client from the API to the worker: exchanges, small JSON calls, error mapping.

Every failure of the transport becomes an ApiError here and nowhere else: before the worker's
head it is EngineUnavailable (nothing was answered), after it engine_lost (partial answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import structlog

from appliance.errors import ApiError, EngineUnavailable, engine_lost
from appliance.settings import ServerSettings

log = structlog.get_logger("appliance.upstream")

# Hop-by-hop and framing headers belong to each connection, never forwarded.
_DROP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-encoding", "proxy-connection",
    "te", "trailer", "upgrade", "date", "server",
})
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
# A pooled keep-alive connection the worker closed while it sat idle fails like this, before a
# byte of the request was read: nothing reached the engine, so a fresh connection is safe.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_STALE_RETRIES = 2


class Reply:
    """The worker's answer once its head arrived: status, headers, then the body on demand."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP}

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except _TRANSPORT_ERRORS as exc:
            raise _lost(exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """What has arrived, as it arrives: under load several events leave in one write."""
        stream = self._response.content
        try:
            while True:
                chunk = await stream.readany()
                if not chunk:
                    return
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise _lost(exc) from exc


class Upstream:
    """One pooled aiohttp session to the worker; every call bounded in time."""

    def __init__(self, base_url: str, server: ServerSettings,
                 retry_after_s: Callable[[], int]) -> None:
        self._base_url = base_url
        self._server = server
        self._retry_after_s = retry_after_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running loop, not to the factory's caller.
        if self._session is None:
            server = self._server
            self._session = aiohttp.ClientSession(
                base_url=self._base_url,
                timeout=aiohttp.ClientTimeout(total=None,
                                              sock_connect=server.upstream_connect_timeout_s,
                                              sock_read=server.upstream_read_timeout_s),
                # Shorter than the worker's own keep-alive (uvicorn's 5 s), so the pool never
                # hands out a connection the worker is closing.
                connector=aiohttp.TCPConnector(limit=server.upstream_max_connections,
                                               keepalive_timeout=server.upstream_keepalive_s),
                trust_env=False,
                auto_decompress=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    @contextlib.asynccontextmanager
    async def exchange(self, method: str, path: str, body: bytes | None,
                       headers: dict[str, str]) -> AsyncIterator[Reply]:
        """Send the request, yield the worker's head; on exit the connection goes back to the
        pool if the body was read to its end, else it is closed, which makes vLLM abort."""
        response = await self._send(method, path, body, headers)
        try:
            yield Reply(response)
        finally:
            if response.content.at_eof():
                response.release()
            else:
                response.close()

    async def call(self, method: str, path: str, payload: Any = None,
                   timeout_s: float = 30.0) -> tuple[int, Any]:
        """A small JSON exchange (tokenize, models): status and decoded body (None if not JSON)."""
        body = None if payload is None else msgspec.json.encode(payload)
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            async with asyncio.timeout(timeout_s), self.exchange(method, path, body, headers) as reply:
                content = await reply.read()
        except TimeoutError as exc:
            raise self._unavailable(exc) from exc
        try:
            return reply.status, msgspec.json.decode(content)
        except (msgspec.DecodeError, RecursionError):
            return reply.status, None

    async def _send(self, method: str, path: str, body: bytes | None,
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        for attempt in range(_STALE_RETRIES + 1):
            try:
                return await self._client().request(method, path, data=body, headers=headers)
            except aiohttp.ClientConnectorError as exc:  # nothing listens: no worker to retry on
                raise self._unavailable(exc) from exc
            except _STALE_CONNECTION as exc:
                if attempt == _STALE_RETRIES:
                    raise self._unavailable(exc) from exc
                log.info("upstream.stale_connection_retried", error=type(exc).__name__)
            except _TRANSPORT_ERRORS as exc:
                raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")  # the loop returns or raises

    def _unavailable(self, exc: BaseException) -> ApiError:
        log.warning("upstream.unreachable", error=type(exc).__name__)
        return EngineUnavailable("the engine is not answering; retry shortly",
                                 code="engine_unavailable", retry_after_s=self._retry_after_s(),
                                 reason="engine_unreachable")


def _lost(exc: BaseException) -> ApiError:
    log.warning("upstream.lost", error=type(exc).__name__)
    return engine_lost(retry_after_s=1)
