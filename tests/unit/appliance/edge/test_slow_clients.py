"""Slow clients (issue 9 #2): a request takes an admission slot only once its body is read, and
reading the headers and reading the body each have a time limit."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from load.kit.rawclient import Conn, Reply, Stalled, request_head
from tests.support.stack import Stack
from tests.unit.appliance.edge.conftest import boot
from tests.unit.appliance.edge.limits import CUT_OFF_S, PHASE_TIMEOUT_S, QUICK_S

MAX_INFLIGHT = 4
SLOW = 2 * MAX_INFLIGHT  # more slow clients than there are slots
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BODY = json.dumps(CHAT).encode().ljust(1000)  # JSON allows trailing whitespace


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with boot(tmp_path_factory, policy__max_inflight=MAX_INFLIGHT) as running:
        yield running


def _head(stack: Stack) -> bytes:
    return request_head("POST", "/v1/chat/completions", stack.target,
                        [("Content-Type", "application/json")], content_length=len(BODY))


@contextlib.contextmanager
def stalled_bodies(stack: Stack, count: int) -> Iterator[list[Conn]]:
    """`count` clients that send the headers and 10 bytes of a 1,000-byte body, then wait."""
    with contextlib.ExitStack() as opened:
        conns = [opened.enter_context(Conn(stack.target)) for _ in range(count)]
        for conn in conns:
            assert conn.send(_head(stack) + BODY[:10])
        yield conns


def _in_flight(stack: Stack) -> float:
    return stack.metrics().get(("appliance_requests_in_flight", frozenset()), 0.0)


def _connections(stack: Stack) -> float:
    return stack.metrics().get(("appliance_connections_open", frozenset()), 0.0)


def _cut_off(conn: Conn, within_s: float) -> Reply | None:
    """The hang-up or the 408 that ends a stalled phase; None if still open at the deadline."""
    try:
        return conn.reply(within_s)
    except Stalled:
        return None


def _assert_cut_off(conns: list[Conn], started: float) -> None:
    for conn in conns:
        outcome = _cut_off(conn, max(0.1, started + CUT_OFF_S - time.monotonic()))
        assert outcome is not None, f"a stalled client still held its connection after {CUT_OFF_S}s"
        assert outcome.status in (None, 408), f"answered {outcome.status}, not a 408 or a hang-up"


def test_stalled_bodies_take_no_admission_slot(stack: Stack) -> None:
    """#2: twice as many stalled bodies as slots, and an honest request is still served (200)."""
    baseline = _connections(stack)
    with stalled_bodies(stack, SLOW):
        # Every stalled connection accepted, its head and 10 bytes already in its buffer: the
        # edge parses those on its next turn, long before the honest request below is served.
        deadline = time.monotonic() + QUICK_S
        while _connections(stack) < baseline + SLOW:
            assert time.monotonic() < deadline, "the stalled clients were never accepted"
            time.sleep(0.05)
        honest = httpx.post(f"{stack.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert honest.status_code == 200, honest.text
        assert _in_flight(stack) == 0, "a stalled body holds an admission slot"


def test_stalled_bodies_are_cut_off_within_the_body_timeout(stack: Stack) -> None:
    """#2: a body that stops arriving ends in a hang-up or 408 within the timeout (+ slack), and
    nothing stays in flight."""
    started = time.monotonic()
    with stalled_bodies(stack, SLOW) as conns:
        _assert_cut_off(conns, started)
    assert _in_flight(stack) == 0


def test_a_body_timeout_ends_the_connection(stack: Stack) -> None:
    """#2: the 408 for a stalled body closes the connection (the rest of the body is unread, so
    nothing more on it can be parsed as a request): it says `Connection: close` or the server
    hangs up within a second, rather than holding the descriptor for an idle timeout more."""
    with stalled_bodies(stack, 1) as (conn,):
        answer = conn.reply(CUT_OFF_S)
        assert answer.status == 408, answer.status
        if "close" in answer.headers.get("connection", "").lower():
            return
        try:
            assert conn.reply(1.0).hung_up, "another answer on a connection with a body unread"
        except Stalled:
            pytest.fail("the connection stayed open after the 408")


def test_a_trickled_body_is_cut_off_within_the_body_timeout(stack: Stack) -> None:
    """#2: a byte every 0.2 s keeps a per-read timer happy; the body's total time is bounded."""
    with Conn(stack.target) as conn:
        started = time.monotonic()
        assert conn.send(_head(stack))
        still_listening = conn.send_slowly(BODY, piece=1, gap_s=0.2, until_s=CUT_OFF_S)
        assert not still_listening, f"still taking a trickled body after {CUT_OFF_S}s"
        _assert_cut_off([conn], started)


def test_stalled_headers_are_cut_off_within_the_header_timeout(stack: Stack) -> None:
    """#2: a request line and half the headers, then nothing: hang-up or 408 in time."""
    started = time.monotonic()
    with contextlib.ExitStack() as opened:
        conns = [opened.enter_context(Conn(stack.target)) for _ in range(SLOW)]
        for conn in conns:
            assert conn.send(_head(stack)[:40])
        _assert_cut_off(conns, started)


def test_trickled_headers_are_cut_off_within_the_header_timeout(stack: Stack) -> None:
    """#2: slowloris: one more header line every 0.2 s, for ever; the head's total time is
    bounded."""
    endless = b"".join(f"X-Slow-{i}: {i}\r\n".encode() for i in range(1000))
    with Conn(stack.target) as conn:
        started = time.monotonic()
        assert conn.send(b"GET /livez HTTP/1.1\r\nHost: localhost\r\n")
        still_listening = conn.send_slowly(endless, piece=12, gap_s=0.2, until_s=CUT_OFF_S)
        assert not still_listening, f"still taking header lines after {CUT_OFF_S}s"
        _assert_cut_off([conn], started)


def test_a_slow_but_steady_honest_body_is_served(stack: Stack) -> None:
    """Guard: a body sent in three pieces within half the body timeout is served (200), so a
    limit cannot pass these tests by cutting off everything that pauses."""
    with Conn(stack.target) as conn:
        assert conn.send(_head(stack))
        pause = PHASE_TIMEOUT_S / 6
        for piece in (BODY[:300], BODY[300:600], BODY[600:]):
            time.sleep(pause)  # the pause between pieces is the behaviour under test
            assert conn.send(piece)
        reply = conn.reply(10)
    assert reply.status == 200, reply.body[:300]


@pytest.mark.parametrize("first", [
    b"GET /livez HTTP/1.1\r\nHost: localhost\r\n\r\n",  # answered; then blank lines
    b"GET /livez HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000\r\n\r\n",  # unread body
], ids=["blank-lines-after-an-answer", "a-body-the-route-never-reads"])
def test_bytes_trickled_after_an_answer_are_cut_off_within_the_header_timeout(
        stack: Stack, first: bytes) -> None:
    """Issue 20 #8: bytes that begin no request stop uvicorn's keep-alive timer at each read;
    the head's deadline runs from the first of them instead."""
    with Conn(stack.target) as conn:
        assert conn.send(first)
        assert conn.reply(10).status == 200
        started = time.monotonic()
        still_listening = conn.send_slowly(b"\r\n" * 1000, piece=2, gap_s=0.3,
                                           until_s=CUT_OFF_S)
        assert not still_listening, f"still taking bytes after {CUT_OFF_S}s"
        _assert_cut_off([conn], started)
