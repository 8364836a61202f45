"""The client link: a relayed stream's events go from the worker's connection straight to the
client's while the client keeps up, and through ASGI while it does not, complete and in order
either way; and the connection itself says when the client is gone."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import httptools
import prometheus_client
import pytest

from appliance.core.sections import ConstraintSettings, ResumeSettings
from appliance.fences.uvicorn import ClientLink
from appliance.policy.cost_watch import CostWatch, Followed
from appliance.proxy import pump as pump_module
from appliance.proxy.pump import Pump
from appliance.recovery.stream import StreamRecord
from tests.unit.appliance.fakes import FakeEngine, appliance, upstream

pytestmark = pytest.mark.anyio

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[bool]]:
    """What the relay said each time a read of the worker came for the client's connection:
    True written straight to it, False left to ASGI (the client not keeping up)."""
    seen: Counter[bool] = Counter()
    write_direct = Pump._write_direct

    def counted(self: Pump, chunk: bytes) -> bool:
        seen[result := write_direct(self, chunk)] += 1
        return result

    monkeypatch.setattr(Pump, "_write_direct", counted)
    yield seen


class Cycle:
    """What a link reads of uvicorn's request-response cycle."""

    def __init__(self) -> None:
        self.disconnected = self.response_complete = self.closing = False
        self.chunked_encoding = True
        self.flow = SimpleNamespace(write_paused=False)
        self.written: list[bytes] = []
        self.transport = SimpleNamespace(is_closing=lambda: self.closing,
                                         write=self.written.append)


NUMBERED = "{n} "  # the synthetic worker's token text: each token's number


def sequence(body: bytes) -> list[int]:
    """The numbers of a stream's tokens (its worker's `word` NUMBERED), in the order they came,
    after the role's event; the [DONE] line must end the stream."""
    events = [json.loads(e.removeprefix("data: ")) for e in body.decode().split("\n\n")
              if e and e != "data: [DONE]"]
    assert body.endswith(b"data: [DONE]\n\n")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    return [int(e["choices"][0]["delta"]["content"].split()[0]) for e in events[1:]]


async def test_a_stream_to_a_client_that_keeps_up_goes_direct_and_whole(writes) -> None:  # type: ignore[no-untyped-def]
    async with upstream(tokens=50, delay=0.002) as (fake, url), \
            appliance(FakeEngine(url)) as client:
        fake.word = NUMBERED
        response = await client.post("/v1/chat/completions", json=CHAT | {"stream": True})
        assert response.status_code == 200
        assert sequence(response.content) == list(range(50))
        metrics = (await client.get("/metrics")).text
    assert writes[True] >= 40 and writes[False] == 0  # a few may come two to a read
    assert "appliance_time_to_first_token_seconds_count" in metrics


async def test_a_direct_stream_keeps_its_records_unread_events_within_the_bound(
        writes, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The direct path appends each event to the record's `kept` itself and has it read once
    past the bound (here 600 bytes, a few events): a long stream is never kept whole."""
    monkeypatch.setattr(pump_module, "KEPT_BYTES", 600)
    reads: list[int] = []
    read_kept = StreamRecord.read_kept

    def counted(self: StreamRecord) -> None:
        reads.append(self.kept_bytes)
        read_kept(self)

    monkeypatch.setattr(StreamRecord, "read_kept", counted)
    async with upstream(tokens=50, delay=0.002) as (fake, url), \
            appliance(FakeEngine(url)) as client:
        fake.word = NUMBERED
        response = await client.post("/v1/chat/completions", json=CHAT | {"stream": True})
        assert sequence(response.content) == list(range(50))
    assert writes[True] >= 40
    big = [n for n in reads if n > 0]
    assert len(big) >= 5 and all(n <= 600 + 400 for n in big)  # past the bound by one event


async def test_a_client_that_stops_reading_gets_every_event_in_order(writes) -> None:  # type: ignore[no-untyped-def]
    """A tiny receive buffer and a reader that sleeps first: the client's socket fills, the
    rest waits in the relay and goes through ASGI, and nothing passes anything."""
    tokens = 2000  # the window is 2048
    async with upstream(tokens=tokens) as (fake, url), appliance(FakeEngine(url)) as client:
        fake.word = NUMBERED + "x" * 5000  # 10 MB in all: more than the sockets between us hold (4 MB)
        port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        payload = json.dumps(CHAT | {"stream": True, "max_tokens": tokens}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
        await asyncio.sleep(1.0)  # not reading: the appliance's socket buffer fills
        body, done = bytearray(), asyncio.Event()

        class Parsed:
            def on_body(self, chunk: bytes) -> None:
                body.extend(chunk)

            def on_message_complete(self) -> None:
                done.set()

        parser = httptools.HttpResponseParser(Parsed())
        while not done.is_set():
            data = await asyncio.wait_for(reader.read(4096), 10)
            assert data, "the appliance closed the connection mid-stream"
            parser.feed_data(data)
        writer.close()
    assert parser.get_status_code() == 200
    assert sequence(bytes(body)) == list(range(tokens))
    assert writes[True] > 0 and writes[False] > 0  # both paths were taken


def test_nothing_is_written_to_a_connection_being_closed() -> None:
    """Closing, but uvicorn not yet told (it hears of it a turn of the loop later)."""
    cycle = Cycle()
    link = ClientLink(cycle)
    assert link.write(b"data: 1\n\n") and cycle.written == [b"9\r\ndata: 1\n\n\r\n"]
    cycle.closing = True
    assert not link.write(b"data: 2\n\n") and len(cycle.written) == 1


def answering(sink_answers: list[bool]) -> tuple[object, list[bytes]]:
    """A worker connection mid-answer (head parsed) whose sink says `sink_answers` in turn."""
    from appliance.core.upstream import _Connection

    conn, offered = _Connection(), []
    conn.transport = SimpleNamespace(pause_reading=lambda: None)  # type: ignore[assignment]
    conn._loop = SimpleNamespace(time=lambda: 0.0)  # type: ignore[assignment]
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    answers = iter(sink_answers)
    conn.sink = lambda chunk: offered.append(chunk) or next(answers)
    return conn, offered


def chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def test_a_chunk_the_sink_refused_keeps_its_place_ahead_of_later_ones() -> None:
    conn, offered = answering([False, True])
    conn.data_received(chunk(b"1"))  # type: ignore[attr-defined]  # refused: buffered
    conn.data_received(chunk(b"2"))  # type: ignore[attr-defined]  # behind it: not offered
    assert offered == [b"1"] and conn.take() == b"12"  # type: ignore[attr-defined]
    conn.data_received(chunk(b"3"))  # type: ignore[attr-defined]  # nothing ahead: to the sink
    assert offered == [b"1", b"3"] and conn.take() == b""  # type: ignore[attr-defined]


def test_what_one_read_carries_goes_to_the_sink_in_one_piece() -> None:
    """Three events in one read: one write to the client, not three."""
    conn, offered = answering([True])
    conn.data_received(chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n")  # type: ignore[attr-defined]
                       + chunk(b"data: 3\n\n"))
    assert offered == [b"data: 1\n\ndata: 2\n\ndata: 3\n\n"]


def test_the_end_of_an_answer_is_left_to_go_out_with_the_end_of_the_response() -> None:
    conn, offered = answering([])
    conn.data_received(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")  # type: ignore[attr-defined]
    assert offered == [] and conn.complete  # type: ignore[attr-defined]
    assert conn.take() == b"data: [DONE]\n\n"  # type: ignore[attr-defined]


async def test_the_last_of_a_stream_goes_with_its_end_in_one_message() -> None:
    """Once the whole answer is in, its last chunk rides on the final ASGI message, which
    uvicorn writes with the chunked terminator: one write where there were two."""
    from appliance.admission.usage import Meter

    pump = stream_pump(None)

    class Reply:
        status, headers, complete = 200, [], False  # type: ignore[var-annotated]

        async def chunks(self):  # type: ignore[no-untyped-def]
            yield b"data: 1\n\n"
            self.complete = True
            yield b"data: [DONE]\n\n"

    sent: list[dict[str, object]] = []

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    disarmed: list[bool] = []
    reply = Reply()
    watch = SimpleNamespace(disarm=lambda: disarmed.append(True), exchange=reply)
    last = await pump.stream(send, reply, reply.chunks(), watch, Meter(False))  # type: ignore[arg-type]
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 1\n\n"] and disarmed
    assert last == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}


async def test_no_event_goes_direct_while_an_earlier_one_is_on_its_way_through_asgi() -> None:
    """While the relay task's send of a buffered chunk waits, a newer chunk must not pass it."""
    from appliance.admission.usage import Meter

    cycle = Cycle()
    pump = stream_pump(ClientLink(cycle))

    class Reply:
        status, headers, complete = 200, [], False  # type: ignore[var-annotated]
        sink = None

        def forward(self, sink):  # type: ignore[no-untyped-def]
            self.sink = sink

        async def chunks(self):  # type: ignore[no-untyped-def]
            yield b"data: first\n\n"  # the one the client could not take at once

    reply, while_sending = Reply(), []

    async def send(message):  # type: ignore[no-untyped-def]
        if message["type"] == "http.response.body":
            while_sending.append(reply.sink(b"data: second\n\n"))  # type: ignore[misc]

    watch = SimpleNamespace(disarm=lambda: None, exchange=reply)
    last = await pump.stream(send, reply, reply.chunks(), watch, Meter(False))  # type: ignore[arg-type]
    assert while_sending == [False] and cycle.written == []
    assert last == {"type": "http.response.body", "body": b"", "more_body": False}


def test_the_link_says_once_that_the_client_went_before_its_answer_was_complete() -> None:
    cycle, calls = Cycle(), []
    link = ClientLink(cycle)
    link.on_gone(lambda: calls.append("gone"))
    link.lost()
    link.lost()
    assert calls == ["gone"]


def test_the_link_says_nothing_once_the_answer_is_complete_or_the_watch_left() -> None:
    cycle, calls = Cycle(), []
    link = ClientLink(cycle)
    forget = link.on_gone(lambda: calls.append("left"))
    forget()
    link.lost()
    link.on_gone(lambda: calls.append("complete"))
    cycle.response_complete = True
    link.lost()
    assert calls == []


def test_a_client_already_gone_is_said_at_once() -> None:
    cycle, calls = Cycle(), []
    cycle.disconnected = True
    ClientLink(cycle).on_gone(lambda: calls.append("gone"))
    assert calls == ["gone"]


def test_the_link_does_not_keep_the_request_alive() -> None:
    """uvicorn's cycle holds the scope, the scope holds the link: the link must hold the cycle
    weakly, or every request would be a reference cycle left for the collector."""
    import gc
    import weakref

    class Bare:  # uvicorn's cycle, as far as references go
        scope: dict[str, object]

    cycle = Bare()
    cycle.scope = {"extensions": {"link": ClientLink(cycle)}}
    gone = weakref.ref(cycle)
    gc.disable()
    try:
        del cycle
        assert gone() is None  # freed by its reference count, no collection needed
    finally:
        gc.enable()


@pytest.mark.parametrize("linked", [True, False])
async def test_the_watch_cancels_its_task_when_the_client_goes(linked: bool) -> None:
    """Through the link where the server gives one (receive() then never says a thing),
    else by a task waiting in receive()."""
    from appliance.proxy.watch import Watch

    cycle, said = Cycle(), asyncio.Event()

    async def receive() -> dict[str, object]:
        await said.wait()
        return {"type": "http.disconnect"}

    engine = SimpleNamespace(on_lost=lambda _: lambda: None)
    link = ClientLink(cycle) if linked else None
    watch = Watch(receive, engine, link)  # type: ignore[arg-type]

    async def owner() -> None:
        with watch:
            await asyncio.sleep(10)

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)
    if link is not None:
        link.lost()
    else:
        said.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 1)
    assert watch.reason == "client_disconnected"


async def test_cancelling_requests_leaves_no_garbage_for_the_collector() -> None:
    """A request served from start to end frees what it made by reference counting alone
    (a cancelled listener task, or a link holding its cycle, left cycles every request)."""
    import gc

    async with upstream(tokens=2) as (_, url), appliance(FakeEngine(url)) as client:
        for body in (CHAT, CHAT | {"stream": True}):  # warm: imports, caches, the connection
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for body in (CHAT, CHAT | {"stream": True}) * 5:
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            gc.collect()
            kinds = Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert kinds["RequestResponseCycle"] == 0 and kinds["Watch"] == 0, kinds


def stream_pump(link: ClientLink | None) -> Pump:
    """The pump of a chat stream, as the relay makes one for a request at the engine."""
    from prometheus_client import CollectorRegistry

    from appliance.apis.openai.api import CHAT
    from appliance.gate.gate import Vetted
    from appliance.observe.metrics import RequestMetrics
    from appliance.proxy.request import Ticket

    deps = SimpleNamespace(metrics=RequestMetrics(CollectorRegistry()), resume=ResumeSettings(),
                           engine=FakeEngine("http://127.0.0.1:9"))
    ticket = Ticket(Vetted(CHAT, {"stream": True}, b"{}"), "rid", "/v1/chat/completions", {})
    pump = Pump(ticket, deps, link, time.perf_counter())  # type: ignore[arg-type]
    pump.cost = followed()
    return pump


def followed() -> Followed:
    """A request as the cost watch follows it once it is at the engine (the relay's __call__
    does this before the stream these tests drive)."""
    counter = prometheus_client.Counter("too_costly", "",
                                        registry=prometheus_client.CollectorRegistry())
    watch = CostWatch(ConstraintSettings(), counter)
    return watch.follow({}, lambda: None).__enter__()
