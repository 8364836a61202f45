"""The connection edge: bounded connections, bounded time and size for a request's head.

uvicorn (httptools) accepts headers of any size and count and keeps a connection that sends
nothing open forever. This protocol adds, per connection:
- a cap on open connections, counted from the accept (a TLS connection still in its handshake,
  which server.tls_handshake_timeout_s bounds, is one): beyond it a new connection gets 503 and
  is closed at once (with TLS, closed before its handshake: there is no HTTP yet to answer in);
- a deadline for the request head (request line and headers), from the moment the connection
  opens or the first byte after an answer: a silent or slow-loris client is closed (408), and
  so is one that trickles bytes that begin no request (blank lines, the rest of a body the
  route never read), which would otherwise stop uvicorn's keep-alive timer at every read;
  between requests, that timer (server.idle_timeout_s) closes idle connections;
- limits on the head's bytes and header count, checked as bytes arrive and (by the fence, which
  tells `head_too_large`) as the parser reports the request line and each header (a whole head
  may come in one read): 431, close.
The request body is read by the route, within server.body_timeout_s.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.answers.answer import error_answer
from appliance.apis.openai.api import OPENAI
from appliance.core.errors import ApiError, HeadersTooLarge, RequestTimeout, ServiceUnavailable
from appliance.core.sections import ServerSettings
from appliance.fences.uvicorn import Connection
from appliance.observe.metrics import UNROUTED


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("appliance_connections_open", "Client connections open now.",
                          registry=registry)
        self.closed = Counter("appliance_connections_closed",
                              "Connections the edge closed, by reason.", ["reason"],
                              registry=registry)

    def error_answered(self, error: ApiError, route: str) -> None:
        """The edge's refusals are counted as the connections they close."""
        self.closed.labels(reason=error.reason).inc()


def edge_protocol(server: ServerSettings, metrics: EdgeMetrics) -> type[Connection]:
    """A connection class (uvicorn's, through its fence) with this appliance's limits bound in."""

    class EdgeProtocol(Connection):
        max_headers = server.max_headers
        max_head_bytes = server.max_header_bytes
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        # watching_reads: between requests or inside a request's head (the reads the edge
        # counts and times)

        def accepted(self) -> None:
            metrics.open.set(self.open_connections)
            if self.open_connections <= server.max_connections:
                return
            if self.handshaking:  # before TLS speaks there is no HTTP to answer in: a hang-up
                metrics.closed.labels(reason="over_capacity").inc()
                self.close()
                return
            self._refuse(ServiceUnavailable("too many connections; retry shortly",
                                            retry_after_s=1, code="over_capacity"))

        def opened(self) -> None:
            self._arm_head_timer()

        def closed(self) -> None:
            self._disarm_head_timer()
            metrics.open.set(self.open_connections)

        def after_read(self, size: int) -> None:
            # Counted after parsing: a chunk that completed the head may carry body bytes too.
            # The parser holds at most the limit plus one read's worth of an unfinished head.
            self._head_bytes += size
            if self._head_bytes > server.max_header_bytes:
                self.head_too_large(headers=False)

        def read_begins(self) -> None:
            if self._head_timer is None:
                self._arm_head_timer()  # uvicorn's keep-alive timer stops at this read

        def head_begins(self) -> None:
            self.watching_reads = True
            if self._head_timer is None:  # a pipelined request, in the read that ended one
                self._arm_head_timer()

        def head_too_large(self, headers: bool) -> None:
            if headers:
                self._refuse(HeadersTooLarge("too many headers (setting server.max_headers)",
                                             code="too_many_headers"))
                return
            self._refuse(HeadersTooLarge("request head too large (setting "
                                         "server.max_header_bytes)", code="head_too_large"))

        def head_done(self) -> None:
            self.watching_reads, self._head_bytes = False, 0
            self._disarm_head_timer()

        def response_done(self) -> None:
            self.watching_reads = True

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.event_loop.call_later(server.header_timeout_s,
                                                          self._head_timeout)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._head_bytes == 0:  # a connection that never said anything
                metrics.closed.labels(reason="silent").inc()
                self.close()
                return
            self._refuse(RequestTimeout("the request head did not arrive in time "
                                        "(setting server.header_timeout_s)", code="header_timeout"))

        def _refuse(self, error: ApiError) -> None:
            """Answer before any route ran (OpenAI's shape: no route chose one) and close."""
            if self.closing():
                metrics.error_answered(error, UNROUTED)  # nobody left to answer; still counted
                return
            self.write_and_close(error_answer(error, OPENAI, None, metrics, peer=self.peer).http1())
            self._disarm_head_timer()

    return EdgeProtocol
