"""The uvicorn fence's contract: what appliance/fences/uvicorn.py assumes of the installed uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ssl
from asyncio import sslproto
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.fences.uvicorn import ApiServer, ClientLink, Connection, client_link, listener
from load.kit.certs import self_signed
from load.kit.net import free_port
from tests.unit.appliance.fakes import eventually
from tests.unit.fences.contract import Fence

UVICORN = Fence("appliance/fences/uvicorn.py", "uvicorn")
ASYNCIO = Fence("appliance/fences/uvicorn.py", "python")  # asyncio's TLS layer: the stdlib's

pytestmark = pytest.mark.anyio


def test_the_server_serves_inside_capture_signals_and_waits_in_main_loop() -> None:
    """ApiServer replaces both: a uvicorn that signals or loops elsewhere would bypass it."""
    UVICORN.body(uvicorn.Server.serve, "with self.capture_signals():\n"
                                        "    await self._serve(sockets)")
    serve_inner = inspect.getsource(UVICORN.attribute(uvicorn.Server, "_serve"))
    UVICORN.require("await self.main_loop()" in serve_inner,
                    "Server._serve awaits self.main_loop() between startup and shutdown")
    UVICORN.body(uvicorn.Server.main_loop,
                 "counter = 0\n"
                 "should_exit = await self.on_tick(counter)\n"
                 "while not should_exit:\n"
                 "    counter += 1\n"
                 "    counter = counter % 864000\n"
                 "    await asyncio.sleep(0.1)\n"
                 "    should_exit = await self.on_tick(counter)")
    UVICORN.parameters(uvicorn.Server.on_tick, ["self", "counter"])
    tick = inspect.getsource(uvicorn.Server.on_tick)
    UVICORN.require("if counter % 10 == 0:" in tick and "default_headers" in tick,
                    "on_tick(0) refreshes the Date header (server_state.default_headers)")


def test_the_protocol_has_the_callbacks_connection_overrides() -> None:
    for name, parameters in [("connection_made", ["self", "transport"]),
                             ("connection_lost", ["self", "exc"]),
                             ("data_received", ["self", "data"]),
                             ("on_message_begin", ["self"]),
                             ("on_url", ["self", "url"]),
                             ("on_header", ["self", "name", "value"]),
                             ("on_headers_complete", ["self"]),
                             ("on_response_complete", ["self"]),
                             ("send_400_response", ["self", "msg"])]:
        UVICORN.parameters(UVICORN.attribute(HttpToolsProtocol, name), parameters)
    ours = {name for name, _ in inspect.getmembers(Connection)} - set(dir(HttpToolsProtocol))
    hooks = {"accepted", "handshaking", "tls_accepted", "tls_ended", "opened", "read_begins",
             "after_read", "head_begins", "head_too_large", "head_done", "response_done",
             "closed", "open_connections", "peer", "event_loop", "closing", "write_and_close",
             "close", "max_headers", "max_head_bytes", "watching_reads"}
    UVICORN.require(hooks <= ours, "none of Connection's own names is one of HttpToolsProtocol's",
                    sorted(hooks - ours))


class Recording(Connection):
    """Records the hooks in the order uvicorn's callbacks run them."""

    seen: list[str] = []

    def opened(self) -> None:
        self.seen.append(f"opened {self.open_connections} {self.peer is not None}")

    def head_begins(self) -> None:
        self.seen.append("head_begins")

    def head_too_large(self, headers: bool) -> None:
        self.seen.append(f"too large {'headers' if headers else 'bytes'}")
        self.close()

    def head_done(self) -> None:
        self.seen.append("head_done")

    def after_read(self, size: int) -> None:
        self.seen.append(f"read {size}")

    def response_done(self) -> None:
        self.seen.append("response_done")

    def closed(self) -> None:
        self.seen.append("closed")


async def one_exchange(app: Any, protocol: type[Recording], request: bytes) -> bytes:
    """`request` sent to a real server of `protocol` on a fresh connection; all it answered,
    once the connection was closed and the protocol heard it."""
    Recording.seen = []
    port = free_port()
    server = ApiServer(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol,
                                      log_config=None, lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        answer = await reader.read()
        writer.close()
        await eventually(lambda: "closed" in Recording.seen)
    finally:
        server.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    return answer


async def test_a_real_request_runs_the_hooks_in_order_and_the_link_writes_chunks() -> None:
    """uvicorn's protocol, cycle and chunked writer as the fence uses them, on a real socket."""
    links: list[tuple[ClientLink | None, bool, bool]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        link = client_link(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        wrote = link.write(b"direct") if link is not None else False
        links.append((link, link is not None and link.has_body(), wrote))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    request = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    answer = await one_exchange(app, Recording, request)
    UVICORN.require(links and links[0][0] is not None,
                    "on_headers_complete sets self.cycle, whose scope is self.scope", links)
    UVICORN.require(links[0][1], "a GET's cycle has more_body False once its head is in")
    UVICORN.require(links[0][2] and b"6\r\ndirect\r\n" in answer,
                    "a response begun without content-length is chunked "
                    "(cycle.chunked_encoding) and its transport takes our chunk", answer)
    expected = ["opened 1 True", "head_begins", "head_done",
                f"read {len(request)}", "response_done", "closed"]
    UVICORN.require(Recording.seen == expected, "the callbacks run in the order "
                    + " > ".join(expected), Recording.seen)


class FewHeaders(Recording):
    max_headers = 2


class ShortHead(Recording):
    max_head_bytes = 30  # "/" (1) and "host: x" (11): 12; a third header line passes it


@pytest.mark.parametrize(("protocol", "kind"), [(FewHeaders, "headers"), (ShortHead, "bytes")])
async def test_the_fence_counts_a_heads_headers_and_bytes_and_stops_the_parse_past_a_bound(
        protocol: type[Recording], kind: str) -> None:
    """On a real socket: a head past a bound, all in one read, is refused by the hook before
    any route runs; the same head within the bounds reaches the app (the test above)."""
    routed: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            routed.append(scope["path"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    answer = await one_exchange(app, protocol, b"GET / HTTP/1.1\r\nhost: x\r\naccept: */*\r\n"
                                b"x-one-more: 12345678\r\n\r\n")
    assert Recording.seen == ["opened 1 True", "head_begins", f"too large {kind}", "closed"]
    assert routed == [] and answer == b""  # no route ran; uvicorn's own 400 was not sent


def test_uvicorn_calls_a_non_string_http_setting_per_connection_and_shuts_each_down() -> None:
    """listener() hands uvicorn a factory where it expects a class: uvicorn must call it as is."""
    load = inspect.getsource(uvicorn.Config.load)
    UVICORN.require("self.http_protocol_class = self.http" in load,
                    "Config.load keeps a non-string `http` as the protocol factory")
    startup = inspect.getsource(uvicorn.Server.startup)
    UVICORN.require("return config.http_protocol_class(" in startup and all(
        f"{name}=" in startup for name in ("config", "server_state", "app_state", "_loop")),
        "startup() calls http_protocol_class(config=, server_state=, app_state=, _loop=)")
    shutdown = inspect.getsource(uvicorn.Server.shutdown)
    UVICORN.require("for connection in list(self.server_state.connections):" in shutdown
                    and "connection.shutdown()" in shutdown,
                    "shutdown() calls shutdown() on each protocol in server_state.connections")
    UVICORN.parameters(HttpToolsProtocol.shutdown, ["self"])


def test_asyncio_tls_layer_takes_a_handshake_bound_and_hides_unfinished_handshakes() -> None:
    ASYNCIO.parameters(sslproto.SSLProtocol.__init__,
                       ["self", "loop", "app_protocol", "sslcontext", "waiter", "server_side",
                        "server_hostname", "call_connection_made", "ssl_handshake_timeout",
                        "ssl_shutdown_timeout"])
    ASYNCIO.body(sslproto.SSLProtocol.connection_made, "self._transport = transport\n"
                                                       "self._start_handshake()")
    lost = inspect.getsource(sslproto.SSLProtocol.connection_lost)
    ASYNCIO.require("if self._state != SSLProtocolState.DO_HANDSHAKE:" in lost,
                    "SSLProtocol.connection_lost tells the app nothing during the handshake")


class Counting(Connection):
    """Records the accept, the opening and the close of each connection, and what was open."""

    seen: list[str] = []

    def accepted(self) -> None:
        self.seen.append(f"accepted {self.open_connections} {self.handshaking}")

    def opened(self) -> None:
        self.seen.append(f"opened {self.open_connections} {self.handshaking}")

    def closed(self) -> None:
        self.seen.append(f"closed {self.open_connections}")


async def test_a_tls_listener_counts_from_the_accept_and_bounds_the_handshake(
        tmp_path: Path) -> None:
    """Over a real socket: a silent connection is counted at once and closed at the bound, with
    no HTTP hook but `closed`; an honest TLS client then opens and is served."""
    cert, key = self_signed(tmp_path)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": scope["scheme"].encode()})

    Counting.seen = []
    port = free_port()
    http = listener(Counting, lambda: server_context, handshake_timeout_s=0.5)
    server = ApiServer(uvicorn.Config(app, host="127.0.0.1", port=port, http=http,
                                      log_config=None, lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started)
        _, silent = await asyncio.open_connection("127.0.0.1", port)
        await eventually(lambda: "closed 0" in Counting.seen, within_s=30)
        silent.close()
        client = ssl.create_default_context(cafile=cert)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client,
                                                       server_hostname="localhost")
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
        await eventually(lambda: len(Counting.seen) == 5)
    finally:
        server.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    expected = ["accepted 1 True", "closed 0", "accepted 1 True", "opened 1 False", "closed 0"]
    ASYNCIO.require(Counting.seen == expected, "a TLS connection runs " + " > ".join(expected),
                    Counting.seen)
    UVICORN.require(b"\r\nhttps\r\n" in answer, "the scope's scheme is https over the TLS layer",
                    answer)


def test_uvicorn_has_an_upper_bound_the_installed_version_is_within() -> None:
    UVICORN.bounded()
