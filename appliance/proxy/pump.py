"""Pumping one answer's bytes from the worker to the client: its head, its stream (straight from
the worker's connection to the client's while the client keeps up), and what was relayed so far
(what an error end and a recovery read)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from litestar.types import Message, Send

from appliance.admission.usage import Meter
from appliance.core.upstream import Reply
from appliance.fences.uvicorn import ClientLink
from appliance.policy.cost_watch import Followed
from appliance.proxy.request import RelayDeps, Ticket
from appliance.proxy.watch import Watch
from appliance.recovery.stream import KEPT_BYTES

_NO_CACHE = (b"cache-control", b"no-cache")


class Isolation:
    """The quarantine's isolation lock, held by a suspect sent again until its answer begins or
    its window ends (appliance.proxy.recover.isolate), whichever comes first."""

    __slots__ = ("_lock",)

    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock: asyncio.Lock | None = lock

    @property
    def held(self) -> bool:
        return self._lock is not None

    def leave(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


class Pump:
    """One request's answer on its way to the client, across the exchanges it takes."""

    __slots__ = ("_before_last", "_clean", "_clean_size", "_death", "_first_at", "_key", "_last",
                 "_link", "_metrics", "_outbound", "_refusal", "_request_id", "_route", "_sending",
                 "_waiting", "answering", "arrived", "cost", "isolation", "record", "relayed_any",
                 "started")

    def __init__(self, ticket: Ticket, deps: RelayDeps, link: ClientLink | None,
                 arrived: float) -> None:
        outbound = self._outbound = ticket.outbound
        self._key, self._request_id, self._route = ticket, ticket.request_id, ticket.route
        self._metrics, self._waiting = deps.metrics, deps.engine.waiting
        self._link = link
        self.arrived = arrived
        # The event the worker's stream ends with when its engine died (read in each read that
        # does not end cleanly); None where it writes none.
        self._death = outbound.death
        self._refusal = outbound.refusal  # where the worker's refusal loses its reason
        # How a read of its stream ends when it cannot hold that error (a token event): such a
        # read is not searched (an empty end: every read is).
        self._clean = outbound.clean_end or b""
        self._clean_size = len(self._clean)
        self._last = self._before_last = b""  # the last two chunks relayed (StreamSoFar)
        self.record = outbound.record if deps.resume.enabled else None  # to resume a stream
        self.started = False  # the head has gone to the client
        self.relayed_any = False  # and some of the body: the request can no longer start over
        self.answering = False  # a byte of the answer came in this exchange (Waiting.answering)
        self._sending = False  # a chunk is on its way through ASGI: none may pass it
        self._first_at: float | None = None  # the request's arrival, until the first chunk
        self.isolation: Isolation | None = None  # held while sent again as a suspect
        self.cost: Followed  # from the moment it is at the engine (the cost watch follows it)

    @property
    def so_far(self) -> tuple[bytes, bytes]:
        """The last chunk relayed and the one before it (what a stream's error end reads)."""
        return self._last, self._before_last

    async def head(self, send: Send, reply: Reply) -> None:
        outbound = self._outbound
        headers = reply.headers + _encode_headers(outbound.headers)
        if outbound.stream:
            headers.append(_NO_CACHE)
        headers.append((b"x-request-id", self._request_id.encode("latin-1")))
        self.started = True
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})

    async def stream(self, send: Send, reply: Reply, source: AsyncIterator[bytes],
                     watch: Watch, meter: Meter) -> Message:
        """The head, then the bytes of `source` (the worker's stream across its faults) but the
        last, which goes with the end this returns."""
        self._first_at = self.arrived  # time to first token counts the queue and the prefill
        await self.head(send, reply)
        self.forward(reply, meter)
        held = b""  # once the whole answer is here, the last of it goes out with the end
        async for chunk in meter.tap(source, strip=self._outbound.usage_added):
            if not chunk:
                continue
            self.relayed(chunk)
            if held:
                await self._send_chunk(send, held)
                held = b""
            exchange = watch.exchange
            if exchange is None or exchange.complete:  # nothing is left to wait for
                watch.disarm()  # the engine owes nothing more; what is here is delivered
                held = chunk
                continue
            await self._send_chunk(send, chunk)
        watch.disarm()
        return {"type": "http.response.body", "body": held, "more_body": False}

    def forward(self, reply: Reply, meter: Meter) -> None:
        """Each event straight from the worker's connection to the client's while the client
        keeps up; what it cannot take yet comes through the loop in `stream`."""
        if self._link is not None and not meter.enabled:
            reply.forward(self._write_direct)

    async def _send_chunk(self, send: Send, chunk: bytes) -> None:
        self._sending = True
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self._sending = False

    def _write_direct(self, chunk: bytes) -> bool:
        """One read of the worker, straight to the client's connection; False: the loop in
        `stream` takes it (the client is not keeping up, an ASGI send is under way, or the
        engine died: that is the loop's to handle). A stream's every event comes here. A read
        that ends with a token event (the API's clean end) holds no error event of a death: of
        a steady stream, it costs the write, an append to its record's `kept` and what
        `relayed` does for a steady stream's event, inline, with no search and no call."""
        if self._sending:
            return False
        record = self.record
        if (not self._clean_size or chunk[-self._clean_size:] != self._clean
                or (record is not None and not record.verbatim)):
            return self._write_searched(chunk)
        link = self._link
        assert link is not None
        if not link.write(chunk):
            return False
        if record is not None:  # kept as it came (Record.kept: no call per event)
            record.kept.append(chunk)
            record.kept_bytes += len(chunk)
            if record.kept_bytes > KEPT_BYTES:
                record.read_kept()
        if self.answering:  # what `relayed` does for a steady stream's event, with no call
            self._before_last, self._last = self._last, chunk
            cost = self.cost
            if cost.measuring:
                cost.progressed(chunk)
        else:
            self.relayed(chunk)
        return True

    def _write_searched(self, chunk: bytes) -> bool:
        """_write_direct's read that may hold a death's error event, or that the record reads."""
        if (self._death is not None and self._death.told(chunk)) or (
                self._refusal is not None and self._refusal.told(chunk)):
            return False
        record, link = self.record, self._link
        assert link is not None
        if record is None:
            if not link.write(chunk):
                return False
        else:
            if not link.writable():  # asked before the record takes the chunk: it takes it once
                return False
            chunk = record.take(chunk)
            if not chunk:
                return True
            link.write(chunk)
        self.relayed(chunk)
        return True

    def relayed(self, chunk: bytes) -> None:
        """Each chunk on its way to the client (for a stream from a real worker: each token)."""
        if not self.answering:
            self._answer_began()
        self._before_last, self._last = self._last, chunk  # what a stream's error end reads
        if self.cost.measuring:  # most streams' tokens are not timed (CostWatch.timed)
            self.cost.progressed(chunk)

    def _answer_began(self) -> None:
        """The first chunk of an exchange: the worker took the request up."""
        if self._first_at is not None:
            self._metrics.first_token(self._route, time.perf_counter() - self._first_at)
            self._first_at = None
        self.relayed_any = True
        self.answering = True  # it owes no first token
        self._waiting.answering(self._key)
        if self.isolation is not None:  # its answer began: the next suspect may go
            self.isolation.leave()


def _encode_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
