"""The fence around uvicorn's internals: the one module that leans on what uvicorn does not promise.

It offers the rest of the tree four things of its own:
- `ApiServer`: uvicorn's Server without its signal handling, with a prompt `stop()`;
- `Connection`: uvicorn's httptools protocol with hooks (`accepted`, `opened`, `read_begins`,
  `after_read`, `head_begins`, `head_too_large`, `head_done`, `response_done`, `closed`) where
  the edge adds its limits, and the head's bounds (`max_headers`, `max_head_bytes`), which it
  counts itself: a header of every request costs no call to the edge;
- `listener`: what uvicorn's `http` setting takes, serving a Connection over TLS where there is
  a certificate: a connection counts from the moment it is accepted and its handshake is bounded
  (uvicorn hands TLS to asyncio, whose handshake may take 60 s, and its protocol hears of a
  connection only once the handshake is done);
- `ClientLink`: one request's link to its client's connection, for the relay.

What it relies on (tests/unit/fences/test_uvicorn.py checks each against the installed uvicorn):
- `Server.capture_signals()` is the context manager `serve()` installs its signal handlers in,
  and `Server.main_loop()` is the loop `serve()` waits in, calling `on_tick(counter)`, which
  refreshes the Date header at counter 0 and returns True once `should_exit`;
- `HttpToolsProtocol` has `connections` (the server's set of open ones), `transport`, `loop`,
  `client`, `cycle`, `scope`, and the parser callbacks `on_message_begin`, `on_url`, `on_header`,
  `on_headers_complete`, `on_response_complete`, `send_400_response`; raising from a callback
  stops the parse (uvicorn answers 400 for it, which `send_400_response` here suppresses once
  the connection was refused);
- a `RequestResponseCycle` has `transport`, `flow.write_paused`, `disconnected`, `more_body`,
  `response_complete` and `chunked_encoding`; a chunked body is written as `%x\\r\\n...\\r\\n`;
- `Config.load()` keeps a non-string `http` as the protocol factory, which `startup()` calls with
  keywords (`config`, `server_state`, `app_state`, `_loop`) once per accepted connection, and
  `shutdown()` calls `shutdown()` on each protocol in `server_state.connections`;
- asyncio's `sslproto.SSLProtocol(loop, app_protocol, sslcontext, waiter, server_side, ...,
  ssl_handshake_timeout)` (what `create_server(ssl=...)` wraps each connection in) starts the
  handshake and its deadline in `connection_made`, calls the app's `connection_made` once the
  handshake is done and, for a connection lost during the handshake, never its
  `connection_lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
import weakref
from asyncio import sslproto
from collections.abc import Callable, Iterator
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

CLIENT_LINK = "chat-appliance.client_link"  # the scope extension that carries a ClientLink


class ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the supervisor decides when the API stops.

    uvicorn's main loop wakes ten times a second to see whether it should exit; this one wakes
    once a second (to date the answers, as uvicorn does each tenth turn) and at once on stop().
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        self.should_exit = True
        self._stopping.set()

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # tick 0: the Date header is refreshed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._stopping.wait()


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

    def writable(self) -> bool:
        """Whether uvicorn's cycle takes a chunk of the body written straight to its transport
        now (nothing can change it before the caller's callback returns)."""
        cycle = self._cycle()
        # is_closing() too: a connection being closed is not yet `disconnected` until uvicorn
        # hears of it on a later turn of the loop, and a closed transport refuses writes.
        return cycle is not None and not (
            cycle.disconnected or cycle.flow.write_paused or cycle.response_complete
            or not cycle.chunked_encoding or cycle.transport.is_closing())

    def write(self, body: bytes) -> bool:
        """Writes the chunk if `writable()`, in one call: a stream's every event comes here."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or cycle.flow.write_paused \
                or cycle.response_complete or not cycle.chunked_encoding \
                or cycle.transport.is_closing():
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
        """The connection is gone (called by the connection)."""
        callback, self._gone = self._gone, None
        if callback is not None and not self.complete():
            callback()


def client_link(scope: Any) -> ClientLink | None:
    """The request's link to its client, where a Connection serves it (not under other servers)."""
    link = (scope.get("extensions") or {}).get(CLIENT_LINK)
    return link if isinstance(link, ClientLink) else None


def _nothing() -> None:
    pass


class _StopParse(Exception):
    """Raised from a parser callback once the connection was refused: stops the parse."""


class Connection(HttpToolsProtocol):
    """uvicorn's httptools protocol, with hooks of our own for what the edge adds. A hook runs
    only while the connection is open; `closing()` says whether the edge closed it."""

    # The head's bounds, counted here as the parser reports the request line and each header
    # (a whole head may come in one read): past one, `head_too_large` and the parse stops.
    max_headers = sys.maxsize
    max_head_bytes = sys.maxsize  # the request line's target and the header lines
    # Whether `read_begins` and `after_read` run for a read (the edge watches the reads of a
    # request's head only: a read of a body costs no call).
    watching_reads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._links: list[ClientLink] = []  # of requests whose answer is not complete
        self._tcp: asyncio.BaseTransport | None = None  # while its TLS handshake runs
        self._tls = False
        self._headers_seen = 0  # of the head being parsed
        self._head_seen = 0  # bytes of it, as the parser gave them

    # --- hooks, for subclasses ---------------------------------------------------------------

    def accepted(self) -> None:
        """A client connected, counted in `open_connections` from here: before any TLS
        handshake (`handshaking` says whether one runs)."""

    def opened(self) -> None:
        """The connection speaks HTTP: at once, or once its TLS handshake is done."""

    def read_begins(self) -> None:
        """Bytes arrived, before they are parsed (uvicorn's keep-alive timer stops here)."""

    def after_read(self, size: int) -> None:
        """A read of `size` bytes was parsed (a head may have completed in it)."""

    def head_begins(self) -> None:
        """A request's first byte arrived."""

    def head_too_large(self, headers: bool) -> None:
        """The head went past `max_headers` (`headers`) or `max_head_bytes`; the parse stops
        (the hook answers or closes)."""

    def head_done(self) -> None:
        """The request's head is complete; its body (if any) is the route's to read."""

    def response_done(self) -> None:
        """The answer is complete; uvicorn's keep-alive timer now runs for the connection."""

    def closed(self) -> None:
        """The connection is gone."""

    # --- what the hooks may use ---------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    @property
    def peer(self) -> tuple[str, int] | None:
        return self.client

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    @property
    def handshaking(self) -> bool:
        """Its TLS handshake runs: nothing can be answered on it yet, it can only be closed."""
        return self._tcp is not None

    def closing(self) -> bool:
        return (self._tcp or self.transport).is_closing()

    def write_and_close(self, data: bytes) -> None:
        """Answer outside uvicorn's cycle (a refusal) and close the connection."""
        self.transport.write(data)
        self.transport.close()

    def close(self) -> None:
        (self._tcp or self.transport).close()

    # --- the TLS layer's calls (listener) ----------------------------------------------------

    def tls_accepted(self, tcp: asyncio.BaseTransport) -> None:
        """Accepted, its handshake begun: counted (uvicorn's set; its own connection_made adds
        it again, once TLS speaks) and closed by uvicorn's shutdown like any other."""
        self._tcp, self._tls = tcp, True
        self.connections.add(self)
        self.accepted()

    def tls_ended(self) -> None:
        """The connection is gone. One whose handshake never finished was never uvicorn's: it
        hears nothing of it, so it is uncounted and `closed` here."""
        if self._tcp is not None:
            self._tcp = None
            self.connections.discard(self)
            self.closed()

    # --- uvicorn's protocol, with the hooks in place --------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._tcp = None
        super().connection_made(transport)
        if not self._tls:
            self.accepted()
        if not self.transport.is_closing():
            self.opened()

    def shutdown(self) -> None:
        if self._tcp is not None:  # uvicorn's would close a transport it never had
            self._tcp.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.closed()
        links, self._links = self._links, []
        for link in links:
            link.lost()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.watching_reads:
            self.read_begins()
        super().data_received(data)
        if self.watching_reads and not self.transport.is_closing():  # a head may begin in it
            self.after_read(len(data))

    def on_message_begin(self) -> None:
        self._headers_seen = self._head_seen = 0
        self.head_begins()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_seen += len(url)
        if self._head_seen > self.max_head_bytes:
            self._too_large(headers=False)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Here, not in a hook: once per header of every request.
        self._headers_seen += 1
        self._head_seen += len(name) + len(value) + 4  # ": " and CRLF
        if self._headers_seen > self.max_headers or self._head_seen > self.max_head_bytes:
            self._too_large(headers=self._headers_seen > self.max_headers)
        super().on_header(name, value)

    def _too_large(self, headers: bool) -> None:
        self.head_too_large(headers)
        raise _StopParse

    def send_400_response(self, msg: str) -> None:
        if not self.transport.is_closing():  # not after our own refusal stopped the parse
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        self.head_done()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:
            extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
            link = ClientLink(self.cycle)
            extensions[CLIENT_LINK] = link
            self._links.append(link)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive (server.idle_timeout_s)
        self.response_done()
        self._links = [link for link in self._links if not link.complete()]


class _TlsLayer(sslproto.SSLProtocol):
    """asyncio's TLS for one accepted connection, as `create_server(ssl=...)` would wrap it, with
    our handshake deadline, and telling the Connection of the accept and the end."""

    def __init__(self, app: Connection, context: ssl.SSLContext, handshake_timeout_s: float) -> None:
        # typeshed's stub is narrower than asyncio: its own create_server passes no waiter
        # (None) for a server's connections, and a float bound.
        super().__init__(app.event_loop, app, context, None,  # type: ignore[arg-type]
                         server_side=True,
                         ssl_handshake_timeout=handshake_timeout_s)  # type: ignore[arg-type]
        self._app = app  # SSLProtocol lets go of its own reference when the connection is lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._app.tls_accepted(transport)  # counted first: it may be refused at once
        super().connection_made(transport)  # the handshake begins, and its deadline

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._app.tls_ended()


def listener(protocol: type[Connection], context: Callable[[], ssl.SSLContext] | None,
             handshake_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's `http` setting: the Connection class itself for plain HTTP; with a context (read
    per connection: a reload re-reads it in place), a factory that wraps each connection in TLS.
    uvicorn must then be given no `ssl` of its own."""
    if context is None:
        return protocol

    def accept(**kwargs: Any) -> asyncio.BaseProtocol:
        return _TlsLayer(protocol(**kwargs), context(), handshake_timeout_s)

    # uvicorn's type says a class; it keeps any non-string as the factory it calls (see above).
    return cast(type[asyncio.Protocol], accept)
