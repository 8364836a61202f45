"""The one HTTP client to the worker: the API's exchanges and the supervisor's probes.

The API's relay and calls use one pool on the serving loop; the probes use a pool of their
own on a thread of their own (supervisor/engine/probe.py), so request load never delays them.
The worker is reached over its Unix socket or loopback TCP (appliance/core/worker_address.py).

A minimal HTTP/1.1 client on asyncio protocols with httptools' C parser: the worker is a
known local server (vLLM's uvicorn) that always frames its answers, and a general client
(aiohttp) cost 220 µs of CPU per request here against 25 µs for this one. Keep-alive
connections are pooled; a stream's chunks are handed over as they arrive (several at once
under load) with flow control, so a slow client never makes the appliance buffer a stream.

Every failure of the transport becomes an ApiError here and nowhere else: before the worker's
head it is EngineUnavailable (nothing was answered), after it engine_lost (partial answer).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import httptools
import msgspec
import structlog

from appliance.core.errors import ApiError, EngineUnavailable, engine_lost
from appliance.core.sections import ServerSettings
from appliance.core.worker_address import WorkerAddress

log = structlog.get_logger("appliance.core.upstream")

# Hop-by-hop and framing headers belong to each connection, never forwarded.
_DROP = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"content-encoding",
    b"proxy-connection", b"te", b"trailer", b"upgrade", b"date", b"server",
})
_HIGH_WATER = 256 * 1024  # unread bytes of a stream before the worker's socket is paused
_STALE_RETRIES = 2


class _Lost(Exception):
    """The connection failed; `answered` says whether any byte of the answer had arrived."""

    def __init__(self, why: str, answered: bool) -> None:
        super().__init__(why)
        self.answered = answered


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the worker, one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = time.monotonic()
        self._deadline: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        # One parser for the connection's life: llhttp starts on the next answer where the last
        # one ended, and a connection is reused only after a whole answer that keeps it alive
        # (making one looks up every callback it may call on this protocol).
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.head_done = self.complete = self.answered = self.keep_alive = False
        self.failure: _Lost | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        # Takes what each read carried of the body, or says False to have it buffered for
        # the reader: a stream relayed without a task switch per event (see Reply.forward).
        self.sink: Callable[[bytes], bool] | None = None
        self._for_sink: list[bytes] = []  # body parsed from the current read, for the sink
        self._last_byte = 0.0  # loop time of the last byte; the read deadline counts from it
        self._disarm()

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self._last_byte = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"unparsable answer: {exc}")
            if self.transport is not None:
                self.transport.close()
        finally:
            if pending := self._for_sink:
                # What one read carried goes to the sink in one piece (one write to the client
                # however many events it held). If the answer ended in the same read, it is left
                # to the reader instead, which sends it with the end of the response: one write
                # again. Here, not in a method: a stream's every event comes this way.
                body = pending[0] if len(pending) == 1 else b"".join(pending)
                pending.clear()
                if self.complete or self.sink is None or not self.sink(body):
                    self._buffer(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self.complete:
            self._fail(f"connection lost: {type(exc).__name__ if exc else 'closed'}")

    # --- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once complete
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None and not self.chunks:
            self._for_sink.append(body)  # nothing buffered ahead of it: order is kept
            return
        self._buffer(body)

    def _buffer(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._disarm()
        self._wake()

    # --- the exchange -----------------------------------------------------------------------

    def begin(self, request: bytes, timeout_s: float) -> None:
        """Send the request; from now on the worker owes a byte at least every `timeout_s`."""
        self._reset()
        assert self.transport is not None
        self.transport.write(request)
        self._timeout = timeout_s
        self._last_byte = self._loop.time()
        self._deadline = self._loop.call_at(self._last_byte + timeout_s, self._check_deadline)

    async def wait(self) -> None:
        """Until something new arrived (head, body, end) or the connection failed."""
        if self.failure is not None:
            raise self.failure
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.failure is not None:
            raise self.failure

    def _check_deadline(self) -> None:
        """One timer per exchange, moved on lazily: a byte costs a clock read, not a timer."""
        due = self._last_byte + self._timeout
        if self._paused:  # the silence is ours: the client has not taken what came
            due = self._loop.time() + self._timeout
        if self._loop.time() < due:
            self._deadline = self._loop.call_at(due, self._check_deadline)
            return
        self._deadline = None
        self._fail(f"no byte from the worker for {self._timeout:g}s")

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_byte = self._loop.time()  # the worker's time to answer starts again
            self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return (self.complete and self.keep_alive and self.transport is not None
                and not self.transport.is_closing())

    def close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = _Lost(why, self.answered)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Reply:
    """The worker's answer once its head arrived: status, headers, then the body on demand."""

    __slots__ = ("_conn", "_release", "headers", "status")

    def __init__(self, conn: _Connection, release: Callable[[_Connection], None]) -> None:
        self._conn = conn
        self._release: Callable[[_Connection], None] | None = release
        self.status = conn.status
        self.headers = [(k, v) for k, v in conn.headers if k not in _DROP]

    def close(self) -> None:
        """The exchange is over (once; again is nothing): its connection goes back to the pool
        if the answer was read to its end, else it is closed, which makes vLLM abort."""
        release, self._release = self._release, None
        if release is not None:
            release(self._conn)

    @property
    def complete(self) -> bool:
        """The whole answer has arrived: what chunks() still yields is already here."""
        return self._conn.complete

    async def read(self) -> bytes:
        conn, parts = self._conn, []
        while not conn.complete:
            await self._next()
            parts.append(conn.take())
        parts.append(conn.take())
        return b"".join(parts)

    def abort(self) -> None:
        """Break the exchange: whoever reads the answer gets engine_lost (the engine was declared
        lost while the worker's socket may still be open, a hung worker's for one)."""
        self._conn.sink = None
        self._conn.close()

    def forward(self, sink: Callable[[bytes], bool]) -> None:
        """From now on what each read of the worker carries goes to `sink` in one piece, unless
        the sink says False, chunks wait in the buffer, or the answer ended in that read;
        `chunks()` then yields only those, and ends as ever."""
        self._conn.sink = sink

    async def chunks(self) -> AsyncIterator[bytes]:
        """What has arrived, as it arrives: under load several events leave in one write."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            await self._next()

    async def _next(self) -> None:
        try:
            await self._conn.wait()
        except _Lost as exc:
            raise _lost(exc) from exc


@dataclass(frozen=True)
class Limits:
    """A pool's bounds: connections, and the time to connect, between bytes and kept idle."""

    connect_timeout_s: float
    read_timeout_s: float
    keepalive_s: float
    max_connections: int

    @classmethod
    def of(cls, server: ServerSettings) -> Limits:
        return cls(server.upstream_connect_timeout_s, server.upstream_read_timeout_s,
                   server.upstream_keepalive_s, server.upstream_max_connections)


class Upstream:
    """A pool of connections to the worker; every call bounded in time.

    `quiet`: failures are logged at debug (the probes, which ask while the worker boots)."""

    def __init__(self, base_url: str, limits: Limits, retry_after_s: Callable[[], int], *,
                 quiet: bool = False) -> None:
        self._address = WorkerAddress.parse(base_url)
        self._host_header = self._address.host_header
        self._limits = limits
        self._retry_after_s = retry_after_s
        self._quiet = quiet
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0
        self._freed = asyncio.Condition()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def open(self, method: str, path: str, body: bytes | None,
                   headers: dict[str, str]) -> Reply:
        """Send the request; the worker's head. The caller must `close` the reply (the relay
        puts it on the exit stack that holds whatever else its request holds)."""
        return Reply(await self._send(self._request_bytes(method, path, body, headers)),
                     self._release)

    async def call(self, method: str, path: str, payload: Any = None,
                   timeout_s: float = 30.0) -> tuple[int, Any]:
        """A small JSON exchange (tokenize, models): status and decoded body (None if not JSON)."""
        body = None if payload is None else msgspec.json.encode(payload)
        status, content = await self.fetch(method, path, body, timeout_s)
        try:
            return status, msgspec.json.decode(content)
        except (msgspec.DecodeError, RecursionError):
            return status, None

    async def fetch(self, method: str, path: str, body: bytes | None = None,
                    timeout_s: float = 30.0) -> tuple[int, bytes]:
        """A whole small answer (a JSON body is sent as such): status and body, within
        `timeout_s` in all; ApiError if the worker did not answer."""
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self.open(method, path, body, headers)
                try:
                    return reply.status, await reply.read()
                finally:
                    reply.close()
        except TimeoutError as exc:
            raise self._unavailable(exc) from exc

    def _request_bytes(self, method: str, path: str, body: bytes | None,
                       headers: dict[str, str]) -> bytes:
        lines = [f"{method} {path} HTTP/1.1".encode(), b"host: " + self._host_header]
        lines += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
        if body is not None:
            lines.append(b"content-length: " + str(len(body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")

    async def _send(self, request: bytes) -> _Connection:
        """Write the request and wait for the head. A pooled connection the worker closed while
        it sat idle fails before any byte of an answer: nothing reached the engine, so it is
        tried again on a fresh connection."""
        for attempt in range(_STALE_RETRIES + 1):
            conn, pooled = await self._acquire()
            conn.begin(request, self._limits.read_timeout_s)
            try:
                while not conn.head_done:
                    await conn.wait()
                return conn
            except _Lost as exc:
                self._release(conn)
                if not pooled or exc.answered or attempt == _STALE_RETRIES:
                    raise self._unavailable(exc) from exc
                (log.debug if self._quiet else log.info)(
                    "upstream.stale_connection_retried", error=str(exc))
            except BaseException:
                self._release(conn)  # cancelled (the client left): the close aborts it
                raise
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _acquire(self) -> tuple[_Connection, bool]:
        keepalive = self._limits.keepalive_s
        while self._idle:
            conn = self._idle.pop()
            fresh = time.monotonic() - conn.idle_since < keepalive
            if fresh and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
            self._drop(conn)
        async with self._freed:
            await self._freed.wait_for(lambda: self._open < self._limits.max_connections)
        self._open += 1
        try:
            async with asyncio.timeout(self._limits.connect_timeout_s):
                conn = await self._address.connect(_Connection)
        except (OSError, TimeoutError) as exc:
            self._open -= 1
            raise self._unavailable(exc) from exc
        return conn, False

    def _release(self, conn: _Connection) -> None:
        if conn.reusable:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            return
        self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open -= 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify()

    def _unavailable(self, exc: BaseException) -> ApiError:
        (log.debug if self._quiet else log.warning)(
            "upstream.unreachable", error=str(exc) or type(exc).__name__, worker=str(self._address))
        return EngineUnavailable("the engine is not answering; retry shortly",
                                 code="engine_unavailable", retry_after_s=self._retry_after_s(),
                                 reason="engine_unreachable")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed: the loop this client runs on, the serving one (it halves the
    loop's share of each proxied request) and the probes' own (a third of each probe's CPU)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _lost(exc: BaseException) -> ApiError:
    log.warning("upstream.lost", error=str(exc))
    return engine_lost(retry_after_s=1)
