"""The connection edge: bounded connections, bounded time and size for a request's head.

uvicorn (httptools) accepts headers of any size and count and keeps a connection that sends
nothing open forever. This protocol adds, per connection:
- a cap on open connections: beyond it a new connection gets 503 and is closed at once;
- a deadline for the request head (request line and headers), from the moment the connection
  opens or the first byte after an answer: a silent or slow-loris client is closed (408), and
  so is one that trickles bytes that begin no request (blank lines, the rest of a body the
  route never read), which would otherwise stop uvicorn's keep-alive timer at every read;
  between requests, that timer (server.idle_timeout_s) closes idle connections;
- limits on the head's bytes and header count, checked as bytes arrive and as the parser
  reports the request line and each header (a whole head may come in one read): 431, close.
The request body is read by the route, within server.body_timeout_s.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, cast

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.settings import ServerSettings

log = structlog.get_logger("appliance.edge")

CLIENT_LINK = "chat-appliance.client_link"  # the scope extension that carries a ClientLink


class ClientLink:
    """One request's link to its client's connection, for the relay: it writes a streamed
    answer's body straight to the connection, and it says when the client is gone.

    Writing: from the worker connection's own callback, no task switch and no ASGI send per
    event. Only for a response uvicorn already started in chunked encoding (a relayed stream,
    whose head went through ASGI as usual, so middleware saw its status) and only while the
    client keeps up: `write` says False when the client's socket is paused or gone, and the
    caller then sends the rest through ASGI, which waits for the client as uvicorn does. The
    last message (the chunked terminator) always goes through ASGI, which completes the cycle.

    Gone: `on_gone` calls back from the connection's own `connection_lost`, where ASGI would
    need a task per request parked in `receive()` to hear it, and cancelling that task at the
    end of every request leaves reference cycles for the collector (a cancelled future's
    exception holds its frames).

    The link holds uvicorn's cycle weakly: the cycle's scope holds the link."""

    __slots__ = ("_cycle", "_gone")

    def __init__(self, cycle: Any) -> None:
        self._cycle: Callable[[], Any] = weakref.ref(cycle)  # uvicorn's RequestResponseCycle
        self._gone: Callable[[], None] | None = None

    def write(self, body: bytes) -> bool:
        cycle = self._cycle()
        # is_closing() too: a connection being closed is not yet `disconnected` until uvicorn
        # hears of it on a later turn of the loop, and a closed transport refuses writes.
        if (cycle is None or cycle.disconnected or cycle.flow.write_paused
                or cycle.response_complete or not cycle.chunked_encoding
                or cycle.transport.is_closing()):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def on_gone(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once if the client goes before its answer is complete (at once if
        it already has); the returned function cancels that."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            callback()
            return _nothing
        self._gone = callback

        def cancel() -> None:
            self._gone = None

        return cancel

    def has_body(self) -> bool:
        """The whole request body has arrived: reading it cannot wait on the client."""
        cycle = self._cycle()
        return cycle is not None and not cycle.more_body

    def complete(self) -> bool:
        cycle = self._cycle()
        return cycle is None or cycle.response_complete

    def lost(self) -> None:
        """The connection is gone (called by the edge protocol)."""
        callback, self._gone = self._gone, None
        if callback is not None and not self.complete():
            callback()


def client_link(scope: Any) -> ClientLink | None:
    """The request's link to its client, where this edge serves it (not under other servers)."""
    link = (scope.get("extensions") or {}).get(CLIENT_LINK)
    return link if isinstance(link, ClientLink) else None


def _nothing() -> None:
    pass


class _Refused(Exception):
    """Raised from a parser callback once the connection was refused: stops the parse."""


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("appliance_connections_open", "Client connections open now.",
                          registry=registry)
        self.closed = Counter("appliance_connections_closed",
                              "Connections the edge closed, by reason.", ["reason"],
                              registry=registry)


def edge_protocol(server: ServerSettings, metrics: EdgeMetrics) -> type[HttpToolsProtocol]:
    """An httptools protocol class with this appliance's limits bound in."""

    class EdgeProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            self._header_count = 0
            self._parsed_bytes = 0  # request line and headers as the parser gave them
            self._in_head = True  # between requests or inside a request's head
            self._links: list[ClientLink] = []  # of requests whose answer is not complete

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            metrics.open.set(len(self.connections))
            if len(self.connections) > server.max_connections:
                self._refuse(503, "too many connections; retry shortly", "over_capacity",
                             retry_after=True)
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)
            metrics.open.set(len(self.connections))
            links, self._links = self._links, []
            for link in links:
                link.lost()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head and self._head_timer is None:
                self._arm_head_timer()  # uvicorn's keep-alive timer stops at this read
            super().data_received(data)
            # Counted after parsing: a chunk that completed the head may carry body bytes too.
            # The parser holds at most the limit plus one read's worth of an unfinished head.
            if self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > server.max_header_bytes:
                    self._refuse(431, "request head too large (setting server.max_header_bytes)",
                                 "head_too_large")

        def on_message_begin(self) -> None:
            self._in_head, self._header_count, self._parsed_bytes = True, 0, 0
            if self._head_timer is None:  # a pipelined request, in the read that ended one
                self._arm_head_timer()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > server.max_headers:
                self._refuse(431, "too many headers (setting server.max_headers)",
                             "too_many_headers")
                raise _Refused
            self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def _count_parsed(self, size: int) -> None:
            """The head as parsed so far: bounded even when it all came in one read."""
            self._parsed_bytes += size
            if self._parsed_bytes > server.max_header_bytes:
                self._refuse(431, "request head too large (setting server.max_header_bytes)",
                             "head_too_large")
                raise _Refused

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():  # not after our own refusal stopped the parse
                super().send_400_response(msg)

        def on_headers_complete(self) -> None:
            if self.transport.is_closing():
                return
            self._in_head, self._head_bytes = False, 0
            self._disarm_head_timer()
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.scope is self.scope:
                extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
                link = ClientLink(self.cycle)
                extensions[CLIENT_LINK] = link
                self._links.append(link)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive (server.idle_timeout_s)
            self._in_head = True
            self._links = [link for link in self._links if not link.complete()]

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(server.header_timeout_s, self._head_timeout)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._head_bytes == 0:  # a connection that never said anything
                metrics.closed.labels(reason="silent").inc()
                self.transport.close()
                return
            self._refuse(408, "the request head did not arrive in time "
                              "(setting server.header_timeout_s)", "header_timeout")

        def _refuse(self, status: int, message: str, reason: str,
                    retry_after: bool = False) -> None:
            metrics.closed.labels(reason=reason).inc()
            if self.transport.is_closing():
                return
            log.info("edge.refused", status=status, reason=reason, client=self.client)
            body = msgspec.json.encode({"error": {
                "message": message, "type": "invalid_request_error" if status < 500
                else "service_unavailable", "param": None, "code": reason}})
            head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n"
                    + ("retry-after: 1\r\n" if retry_after else "") + "\r\n")
            self.transport.write(head.encode("ascii") + body)
            self.transport.close()
            self._disarm_head_timer()

    return EdgeProtocol
