"""A lean asyncio HTTP/1.1 load generator for the gateway bench: keep-alive, chunked SSE, timings.

Deliberately not httpx: at tens of thousands of SSE events a second the client's own cost per
chunk decides how much CPU is left for the servers it measures (they share the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

_TOKEN = b'"content"'
_EMPTY = (b'"content": ""', b'"content":""')
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint on loopback; requests are pre-built bytes."""

    name: str
    port: int
    api_key: str = ""
    model: str = "synthetic"
    tls: ssl.SSLContext | None = None  # HTTPS, trusting this context's certificates

    def request(self, stream: bool, max_tokens: int) -> bytes:
        body = json.dumps({"model": self.model, "stream": stream, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": "Say something."}]}).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Content-Type: application/json\r\n{auth}Content-Length: {len(body)}\r\n\r\n")
        return head.encode() + body


@dataclass
class Sample:
    """What one round (or several, merged) measured for one target and mode."""

    requests: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    latency_s: array[float] = field(default_factory=lambda: array("d"))
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    tpot_s: array[float] = field(default_factory=lambda: array("d"))

    def merge(self, other: Sample) -> None:
        self.requests += other.requests
        self.tokens += other.tokens
        self.elapsed_s += other.elapsed_s
        self.errors.update(other.errors)
        self.latency_s.extend(other.latency_s)
        self.ttft_s.extend(other.ttft_s)
        self.tpot_s.extend(other.tpot_s)


class Connection:
    """One keep-alive connection, reopened after an error or a `Connection: close`."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None) -> None:
        self._port, self._tls = port, tls
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, raw: bytes) -> tuple[int, dict[bytes, bytes], asyncio.StreamReader]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(
                "127.0.0.1", self._port, ssl=self._tls,
                server_hostname="127.0.0.1" if self._tls else None)
        reader, writer = self._streams
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if value:
                headers[name.strip().lower()] = value.strip()
        return int(lines[0].split(b" ", 2)[1]), headers, reader

    async def close(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams[1].close()
            with contextlib.suppress(OSError):
                await streams[1].wait_closed()


async def body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, sized, or (last resort) until close."""
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the end of an (empty) trailer section
                return
            yield (await reader.readexactly(size + 2))[:-2]
    elif b"content-length" in headers:
        yield await reader.readexactly(int(headers[b"content-length"]))
    else:
        yield await reader.read()


async def _exchange(conn: Connection, raw: bytes, sample: Sample) -> bool:
    """One request; timings go into the sample. True if the connection may be reused."""
    started = time.perf_counter()
    status, headers, reader = await conn.send(raw)
    first = last = 0.0
    tokens, rest, done = 0, b"", False
    async for data in body(reader, headers):
        now = time.perf_counter()
        *events, rest = (rest + data).split(b"\n\n")
        for event in events:
            if event.startswith(b"data: [DONE]"):
                done = True
            elif _TOKEN in event and not any(e in event for e in _EMPTY):
                tokens += 1
                first, last = first or now, now
    end = time.perf_counter()
    streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
    if status != 200 or (streamed and not done):
        sample.errors[f"status {status}" if status != 200 else "stream without [DONE]"] += 1
    else:
        sample.requests += 1
        sample.latency_s.append(end - started)
    if streamed and tokens:
        sample.tokens += tokens
        sample.ttft_s.append(first - started)
        if tokens > 1:
            sample.tpot_s.append((last - first) / (tokens - 1))
    return headers.get(b"connection", b"").lower() != b"close"


async def _client(target: Target, raw: bytes, until: float, sample: Sample) -> None:
    """One closed-loop client: the next request leaves as soon as the last one ended (on a
    kept-alive connection: a TLS handshake only after an error or a close)."""
    conn = Connection(target.port, target.tls)
    try:
        while time.perf_counter() < until:
            try:
                reuse = await asyncio.wait_for(_exchange(conn, raw, sample), REQUEST_TIMEOUT_S)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ValueError, ssl.SSLError) as exc:
                sample.errors[type(exc).__name__] += 1
                reuse = False
            if not reuse:
                await conn.close()
    finally:
        await conn.close()


async def run_round(target: Target, stream: bool, clients: int, duration_s: float,
                    max_tokens: int) -> Sample:
    """`clients` closed-loop clients for `duration_s`; in-flight requests finish (bounded)."""
    sample = Sample()
    raw = target.request(stream, max_tokens)
    started = time.perf_counter()
    await asyncio.gather(*(_client(target, raw, started + duration_s, sample)
                           for _ in range(clients)))
    sample.elapsed_s = time.perf_counter() - started
    return sample
