"""The upstream proxy: forwards a vetted request to the worker and relays its answer unbuffered."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import structlog

from appliance.engine import EngineState, EngineView
from appliance.errors import ApiError, EngineUnavailable, error_body
from appliance.settings import ServerSettings

log = structlog.get_logger("appliance.proxy")

# Hop-by-hop and framing headers are the proxy's own business, never forwarded.
_DROP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
    "proxy-connection", "te", "trailer", "upgrade", "date", "server",
})
# What a worker that died, hung up or never answered looks like from the client side.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass
class Upstream:
    """The worker's reply before its body: status and headers, then the open response."""

    status: int
    headers: dict[str, str]
    response: aiohttp.ClientResponse
    on_close: list[Callable[[], None]] = field(default_factory=list)
    on_abandon: list[Callable[[], None]] = field(default_factory=list)  # the client left mid-way

    async def read_all(self) -> bytes:
        """The whole body (an error answer, or a non-streaming one), then the connection back."""
        try:
            return await self.response.read()
        except _TRANSPORT_ERRORS as exc:
            raise _lost(exc) from exc
        finally:
            self.response.release()


class Disconnected(Exception):
    """The client went away before the worker answered; the upstream request was closed."""


class Proxy:
    """One pooled HTTP client to the worker; each call has a timeout and a terminal answer."""

    def __init__(self, engine: EngineView, server: ServerSettings) -> None:
        self._engine = engine
        self._server = server
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running loop, not to the factory's caller.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self._engine.base_url,
                timeout=aiohttp.ClientTimeout(total=None,
                                              sock_connect=self._server.upstream_connect_timeout_s,
                                              sock_read=self._server.upstream_read_timeout_s),
                connector=aiohttp.TCPConnector(limit=self._server.upstream_max_connections),
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def ensure_ready(self) -> None:
        """Engine not serving: 503 with Retry-After before any work is done for the request."""
        state = self._engine.state
        if state is not EngineState.READY:
            raise EngineUnavailable(
                f"the engine is {state.value}; retry shortly",
                code="engine_unavailable",
                retry_after_s=self._engine.retry_after_s(),
            )

    async def open(self, method: str, path: str, body: bytes | None,
                   headers: dict[str, str]) -> Upstream:
        """Send the request and wait for the worker's status line and headers, not the body."""
        self.ensure_ready()
        try:
            response = await self._client().request(method, path, data=body, headers=headers)
        except _TRANSPORT_ERRORS as exc:
            raise self.unavailable(exc) from exc
        kept = {k: v for k, v in response.headers.items() if k.lower() not in _DROP}
        return Upstream(response.status, kept, response)

    async def read(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                   disconnected: Callable[[], Awaitable[None]]) -> tuple[Upstream, bytes]:
        """A whole non-streaming exchange; closes the upstream at once if the client leaves."""
        self._engine.note_request(+1)
        exchange = asyncio.ensure_future(self._exchange(method, path, body, headers))
        watchers = [asyncio.ensure_future(disconnected()),
                    asyncio.ensure_future(self._engine.lost().wait())]
        try:
            await asyncio.wait([exchange, *watchers], return_when=asyncio.FIRST_COMPLETED)
            if exchange.done():
                return exchange.result()
            exchange.cancel()  # closes the upstream connection: vLLM aborts the request
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await exchange
            if watchers[0].done():
                raise Disconnected()
            raise EngineUnavailable("the engine stopped while answering this request",
                                    code="engine_lost", retry_after_s=self._engine.retry_after_s())
        finally:
            for watcher in watchers:
                watcher.cancel()
            self._engine.note_request(-1)

    async def _exchange(self, method: str, path: str, body: bytes | None,
                        headers: dict[str, str]) -> tuple[Upstream, bytes]:
        upstream = await self.open(method, path, body, headers)
        try:
            content = await upstream.read_all()
        except asyncio.CancelledError:
            upstream.response.close()  # the client left: drop the connection, vLLM aborts
            raise
        self._engine.note_progress()
        return upstream, content

    async def relay(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """Yield the worker's stream as it comes; a worker lost mid-way ends in an SSE error.

        Closing an aiohttp response is synchronous, so the engine's `lost` event closes it from
        a callback and the read in progress fails at once; no reader task, no queue per chunk.
        """
        response, lost = upstream.response, self._engine.lost()
        self._engine.note_request(+1)
        guard = asyncio.ensure_future(lost.wait())
        guard.add_done_callback(lambda done: None if done.cancelled() else response.close())
        finished = broken = False
        try:
            try:
                async for chunk in response.content.iter_any():
                    self._engine.note_progress()
                    yield chunk
                finished = True
            except _TRANSPORT_ERRORS as exc:
                broken = True
                log.warning("upstream.stream_broken", error=type(exc).__name__,
                            engine_lost=lost.is_set())
                yield sse_error("the engine was restarted mid-stream; partial output above"
                                if lost.is_set() else
                                "the engine stopped mid-stream; partial output above")
        finally:
            guard.cancel()
            if finished:
                response.release()  # read to the end: the connection goes back to the pool
            else:
                response.close()  # closing the socket is what makes vLLM abort the request
            self._engine.note_request(-1)
            callbacks = upstream.on_close + ([] if finished or broken else upstream.on_abandon)
            for callback in callbacks:
                callback()

    def unavailable(self, exc: BaseException) -> ApiError:
        log.warning("upstream.unreachable", error=type(exc).__name__, state=self._engine.state.value)
        return EngineUnavailable(
            "the engine is not answering; retry shortly",
            code="engine_unavailable",
            retry_after_s=self._engine.retry_after_s(),
        )


def _lost(exc: BaseException) -> ApiError:
    log.warning("upstream.lost", error=type(exc).__name__)
    return EngineUnavailable("the engine stopped while answering this request",
                             code="engine_lost", retry_after_s=1)


def sse_error(message: str, code: str = "engine_lost") -> bytes:
    """The terminal SSE pair a client sees when a stream cannot finish: error event, [DONE]."""
    payload = error_body(message, "service_unavailable", None, code)
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"
