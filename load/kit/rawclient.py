"""Raw HTTP/1.1 over loopback sockets: what a hostile client sends, byte for byte, with deadlines.

An HTTP library would fix up what a hostile client gets wrong on purpose (header sizes, partial
bodies, garbage request lines, pipelining), so these helpers write bytes and read them back.
Every wait has a deadline; nothing here retries.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

HeaderItem = tuple[str | bytes, str | bytes]
_CHUNK = 65536


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80)


@dataclass
class Reply:
    """What came back: a status line and headers, or nothing before the server hung up."""

    status: int | None  # None: closed or reset before a complete status line and headers
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    elapsed_s: float = 0.0

    @property
    def hung_up(self) -> bool:
        return self.status is None

    def json(self) -> object:
        return json.loads(self.body)


class Stalled(Exception):
    """The deadline passed with the connection still open and nothing (more) to read."""


def request_head(method: str, path: str, target: Target, headers: Iterable[HeaderItem] = (),
                 *, content_length: int | None = None) -> bytes:
    """A request line and headers, ending in the blank line; values sent exactly as given."""
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: {target.host}:{target.port}".encode()]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}".encode())
    for name, value in headers:
        lines.append(_bytes(name) + b": " + _bytes(value))
    return b"\r\n".join(lines) + b"\r\n\r\n"


def json_request(method: str, path: str, target: Target, body: bytes,
                 headers: Iterable[HeaderItem] = ()) -> bytes:
    extra = [("Content-Type", "application/json"), *headers]
    return request_head(method, path, target, extra, content_length=len(body)) + body


class Conn:
    """One client connection with a read buffer, so pipelined replies are read one by one."""

    def __init__(self, target: Target, timeout_s: float = 5.0) -> None:
        self.sock = socket.create_connection((target.host, target.port), timeout=timeout_s)
        self._buffer = b""
        self._eof = False

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes, timeout_s: float = 10.0) -> bool:
        """Send it all; False when the server closed or reset the connection meanwhile."""
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            return False
        except TimeoutError as exc:
            raise Stalled("the server stopped reading what was sent") from exc
        return True

    def send_slowly(self, data: bytes, piece: int, gap_s: float, until_s: float) -> bool:
        """Trickle `data`, `piece` bytes every `gap_s`, for at most `until_s` seconds.
        True: the server is still silently taking it; False: it answered or hung up."""
        deadline = time.monotonic() + until_s
        for start in range(0, len(data), piece):
            if time.monotonic() >= deadline:
                return True
            if not self.send(data[start:start + piece]) or self._answered_within(gap_s):
                return False
        return True

    def reply(self, timeout_s: float = 10.0) -> Reply:
        """Read one reply; Reply(status=None) if the server hangs up first; Stalled on timeout."""
        started = time.monotonic()
        deadline = started + timeout_s
        head = self._read_until(b"\r\n\r\n", deadline)
        if head is None:
            return Reply(None, elapsed_s=time.monotonic() - started)
        status, headers = _parse_head(head)
        body = self._read_body(headers, deadline)
        return Reply(status, headers, body, time.monotonic() - started)

    def _answered_within(self, seconds: float) -> bool:
        """Wait `seconds` for the server to say anything or hang up (kept for reply())."""
        deadline = time.monotonic() + seconds
        while not (self._eof or self._buffer) and self._fill(deadline):
            pass
        return self._eof or bool(self._buffer)

    def _fill(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(_CHUNK)
        except TimeoutError:
            return False
        except (ConnectionResetError, ConnectionAbortedError):
            data = b""
        if not data:
            self._eof = True
            return False
        self._buffer += data
        return True

    def _read_until(self, marker: bytes, deadline: float) -> bytes | None:
        while marker not in self._buffer:
            if self._eof:
                return None
            if not self._fill(deadline) and not self._eof:
                raise Stalled(f"no reply within the deadline ({len(self._buffer)} bytes read)")
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    def _read_exact(self, size: int, deadline: float) -> bytes:
        while len(self._buffer) < size and not self._eof:
            if not self._fill(deadline) and not self._eof:
                raise Stalled("the body stopped short of its length")
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def _read_body(self, headers: dict[str, str], deadline: float) -> bytes:
        if "content-length" in headers:
            return self._read_exact(int(headers["content-length"]), deadline)
        if "chunked" in headers.get("transfer-encoding", ""):
            return self._read_chunked(deadline)
        while not self._eof and self._fill(deadline):  # neither: the body runs to the close
            pass
        data, self._buffer = self._buffer, b""
        return data

    def _read_chunked(self, deadline: float) -> bytes:
        body = b""
        while True:
            size_line = self._read_until(b"\r\n", deadline)
            if size_line is None:
                return body
            size = int(size_line.split(b";")[0], 16)
            body += self._read_exact(size, deadline)
            self._read_until(b"\r\n", deadline)
            if size == 0:
                return body


def exchange(target: Target, raw: bytes, timeout_s: float = 10.0) -> Reply:
    """Open, send `raw`, read one reply, close."""
    with Conn(target, timeout_s) as conn:
        conn.send(raw, timeout_s)  # a hang-up mid-way still leaves what it said, if anything
        return conn.reply(timeout_s)


def _parse_head(head: bytes) -> tuple[int | None, dict[str, str]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, {}
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return int(parts[1]), headers


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")
