"""The worker client against a scripted raw HTTP server: pooling, stale connections, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import quote

import pytest

from appliance.core.errors import EngineUnavailable
from appliance.core.sections import ServerSettings
from appliance.core.upstream import Limits, Reply, Upstream
from load.kit.net import free_port

pytestmark = pytest.mark.anyio

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class Server:
    """Answers each request with `answer(n)` (n counts requests); records connections."""

    answer: Callable[[int, asyncio.StreamWriter], bytes | None]
    connections: int = 0
    requests: int = 0
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # a request arrived
    heads: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                self.requests += 1
                self.asked.set()
                reply = self.answer(self.requests, writer)
                if reply is None:
                    continue  # never answers: the test cancels
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnected.set()
        finally:
            writer.close()


def address(transport: str) -> tuple[str, str | int]:
    """A worker URL for the transport, and where its listener binds."""
    if transport == "unix":
        path = os.path.join(tempfile.mkdtemp(prefix="ca-upstream-"), "worker.sock")
        return f"http+unix://{quote(path, safe='')}", path
    port = free_port()
    return f"http://127.0.0.1:{port}", port


@contextlib.asynccontextmanager
async def opened(upstream: Upstream) -> AsyncIterator[Reply]:
    """A completion's reply for the block's length, closed on the way out."""
    reply = await upstream.open("POST", "/v1/completions", b"{}", {})
    try:
        yield reply
    finally:
        reply.close()


@contextlib.asynccontextmanager
async def serving(answer: Callable[[int, asyncio.StreamWriter], bytes | None],
                  settings: ServerSettings | None = None, transport: str = "tcp"
                  ) -> AsyncIterator[tuple[Server, Upstream]]:
    server, (url, where) = Server(answer), address(transport)
    if isinstance(where, str):
        listener = await asyncio.start_unix_server(server.handle, where)
    else:
        listener = await asyncio.start_server(server.handle, "127.0.0.1", where)
    upstream = Upstream(url, Limits.of(settings or ServerSettings()), lambda: 3)
    try:
        yield server, upstream
    finally:
        await upstream.aclose()
        listener.close()
        if isinstance(where, str):
            shutil.rmtree(os.path.dirname(where))


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_keep_alive_connections_are_reused(transport: str) -> None:
    async with serving(lambda n, w: OK, transport=transport) as (server, upstream):
        for _ in range(5):
            assert await upstream.call("GET", "/v1/models") == (200, {})
    assert (server.requests, server.connections) == (5, 1)
    host = b"host: localhost" if transport == "unix" else b"host: 127.0.0.1:"
    assert host in server.heads[0]


async def test_a_whole_answer_is_fetched_as_bytes_over_the_unix_socket() -> None:
    """What the probes read: /metrics is text, not JSON."""
    page = b"vllm:num_requests_running 1.0\n"
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(page), page)
    async with serving(lambda n, w: answer, transport="unix") as (_, upstream):
        assert await upstream.fetch("GET", "/metrics", timeout_s=5) == (200, page)


async def test_a_pooled_connection_the_worker_closed_is_retried_on_a_fresh_one() -> None:
    def answer(n: int, writer: asyncio.StreamWriter) -> bytes:
        if n == 1:
            asyncio.get_running_loop().call_later(0.05, writer.close)  # closes it while idle
        return OK

    async with serving(answer) as (server, upstream):
        assert await upstream.call("GET", "/a") == (200, {})
        await asyncio.sleep(0.2)
        assert await upstream.call("GET", "/b") == (200, {})  # no error reaches the caller
    assert server.connections == 2


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_a_worker_gone_mid_answer_is_engine_lost(transport: str) -> None:
    partial = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")

    def answer(n: int, writer: asyncio.StreamWriter) -> bytes:
        asyncio.get_running_loop().call_later(0.05, writer.close)
        return partial

    async with serving(answer, transport=transport) as (_, upstream), \
            opened(upstream) as reply:
        assert reply.status == 200
        with pytest.raises(EngineUnavailable) as caught:
            async for _ in reply.chunks():
                pass
    assert caught.value.code == "engine_lost"


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_nothing_listening_is_engine_unavailable(transport: str) -> None:
    url = ("http+unix://%2Fnonexistent%2Fworker.sock" if transport == "unix"
           else f"http://127.0.0.1:{free_port()}")
    upstream = Upstream(url, Limits.of(ServerSettings()), lambda: 3)
    with pytest.raises(EngineUnavailable) as caught:
        await upstream.call("GET", "/health")
    assert caught.value.code == "engine_unavailable" and caught.value.retry_after_s == 3


async def test_a_caller_that_leaves_closes_the_connection_so_the_worker_aborts() -> None:
    async with serving(lambda n, w: None) as (server, upstream):
        call = asyncio.create_task(upstream.call("POST", "/v1/completions", {"prompt": "x"}))
        await asyncio.wait_for(server.asked.wait(), 5)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await asyncio.wait_for(server.disconnected.wait(), 2)


async def test_a_chunked_stream_is_read_in_order_to_its_end() -> None:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b"data: 1\n\n", b"data: 2\n\n"))
    stream = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
              b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")
    async with serving(lambda n, w: stream) as (server, upstream):
        async with opened(upstream) as reply:
            assert b"".join([chunk async for chunk in reply.chunks()]) == b"data: 1\n\ndata: 2\n\n"
            assert (b"content-type", b"text/event-stream") in reply.headers
            assert not any(name == b"transfer-encoding" for name, _ in reply.headers)
        assert await upstream.call("GET", "/again") == (200, None)  # the connection was reused
    assert server.connections == 1


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")
QUICK = ServerSettings(upstream_read_timeout_s=0.3)


def _drip(events: int, every_s: float) -> Callable[[int, asyncio.StreamWriter], bytes]:
    """The head now, then one event every `every_s`, then the end."""
    def answer(n: int, writer: asyncio.StreamWriter) -> bytes:
        loop = asyncio.get_running_loop()
        for i in range(events):
            loop.call_later(every_s * (i + 1), writer.write, b"9\r\ndata: x\n\n\r\n")
        loop.call_later(every_s * (events + 1), writer.write, b"0\r\n\r\n")
        return STREAM_HEAD
    return answer


async def test_a_worker_silent_past_the_read_timeout_mid_answer_is_engine_lost() -> None:
    async with serving(lambda n, w: STREAM_HEAD, QUICK) as (_, upstream), \
            opened(upstream) as reply:
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineUnavailable) as caught:
            async for _ in reply.chunks():
                pass
    assert caught.value.code == "engine_lost"
    assert 0.25 <= asyncio.get_running_loop().time() - started < 2


async def test_the_read_timeout_counts_from_the_last_byte_not_the_request() -> None:
    """Ten events 0.2 s apart take 2 s in all, far past the 0.3 s timeout: none is late."""
    async with serving(_drip(10, 0.2), QUICK) as (_, upstream), \
            opened(upstream) as reply:
        assert b"".join([chunk async for chunk in reply.chunks()]) == b"data: x\n\n" * 10


async def test_a_worker_that_never_answers_the_head_is_engine_unavailable() -> None:
    async with serving(lambda n, w: None, QUICK) as (_, upstream):
        with pytest.raises(EngineUnavailable) as caught:
            await upstream.call("POST", "/v1/completions", {"prompt": "x"})
    assert caught.value.code == "engine_unavailable"
