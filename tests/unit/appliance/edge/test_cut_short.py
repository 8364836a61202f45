"""A request its client cuts short is the client's doing (issue 20 #5): a body shorter than its
Content-Length, a chunk that cannot be read, a hang-up while the engine works. Each ends in a
400 (or no answer, nobody listening), logged and counted as such: never a 500, never the
unhandled-exception metric that says "a bug, file it", never a traceback."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from load.kit.rawclient import Conn, request_head
from tests.support.stack import Stack
from tests.unit.appliance.edge.conftest import boot

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}).encode()
PATH = "/v1/chat/completions"
CHUNKED = (f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           "Transfer-Encoding: chunked\r\n\r\n").encode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # 40 tokens 50 ms apart: a request is still with the engine when its client hangs up.
    with boot(tmp_path_factory, ("--tokens", "40", "--token-delay", "0.05")) as running:
        yield running


def faults(stack: Stack) -> dict[str, float]:
    """What says "our fault": 5xx answers counted, unhandled exceptions counted."""
    counted = stack.metrics()
    return {
        "5xx": sum(v for (name, labels), v in counted.items()
                   if name == "appliance_requests_total" and dict(labels)["status"][0] == "5"),
        "unhandled": sum(v for (name, _), v in counted.items()
                         if name == "appliance_unhandled_exceptions_total"),
    }


def statuses(stack: Stack) -> dict[str, float]:
    counted = stack.metrics()
    return {dict(labels)["status"]: v for (name, labels), v in counted.items()
            if name == "appliance_requests_total" and dict(labels)["route"] == PATH}


def short_body(conn: Conn, stack: Stack) -> None:
    head = request_head("POST", PATH, stack.target, [("Content-Type", "application/json")],
                        content_length=len(CHAT) + 50)
    assert conn.send(head + CHAT)


def hang_up(conn: Conn) -> None:
    conn.close()


def half_close(conn: Conn) -> None:
    """The client says it has sent everything (its body is still 50 bytes short)."""
    conn.sock.shutdown(socket.SHUT_WR)
    reply = conn.reply(10)
    assert reply.status in (None, 400), reply


def bad_chunk(conn: Conn, stack: Stack) -> None:
    assert conn.send(CHUNKED + b"5\r\n{\"mes\r\nZZ\r\nxx\r\n0\r\n\r\n")
    reply = conn.reply(10)
    assert reply.status == 400, reply


def cut_chunk(conn: Conn, stack: Stack) -> None:
    assert conn.send(CHUNKED + b"5\r\n{\"mes\r\n40\r\nabc")


def done_when_answered(stack: Stack, before: dict[str, float]) -> None:
    """The appliance has finished with the request: a status counted for it."""
    deadline = time.monotonic() + 10
    while sum(statuses(stack).values()) <= sum(before.values()):
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.05)


@pytest.mark.parametrize(("send", "end"), [
    (short_body, hang_up), (short_body, half_close), (cut_chunk, hang_up),
    (bad_chunk, hang_up)], ids=["short-body-hang-up", "short-body-half-close",
                                "cut-chunk-hang-up", "bad-chunk"])
def test_a_body_cut_short_is_the_clients_mistake_not_our_fault(
        stack: Stack, send: Callable[[Conn, Stack], None], end: Callable[[Conn], None]) -> None:
    before, counted_before, lines = faults(stack), statuses(stack), len(stack.log_lines())
    with Conn(stack.target) as conn:
        send(conn, stack)
        end(conn)
    done_when_answered(stack, counted_before)
    assert faults(stack) == before
    after = statuses(stack)
    assert after.get("400", 0) == counted_before.get("400", 0) + 1, after
    new = "\n".join(stack.log_lines()[lines:])
    assert "Traceback" not in new and "request.unhandled_exception" not in new
    assert "body_incomplete" in new


@pytest.mark.parametrize("stream", [False, True])
def test_a_hang_up_while_the_engine_works_is_a_logged_disconnect(stack: Stack,
                                                                 stream: bool) -> None:
    """Counted under status 499 (nginx's "client closed request") when nothing was answered."""
    before, counted_before, lines = faults(stack), statuses(stack), len(stack.log_lines())
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                       "stream": stream}).encode()
    head = request_head("POST", PATH, stack.target, [("Content-Type", "application/json")],
                        content_length=len(body))
    generating = stack.engine_counter("synthetic_generate_calls_total")
    with Conn(stack.target) as conn:
        assert conn.send(head + body)
        deadline = time.monotonic() + 10
        while stack.engine_counter("synthetic_generate_calls_total") == generating:
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.05)
    done_when_answered(stack, counted_before)
    assert faults(stack) == before
    # A stream's head went out before its client left: it is counted as answered.
    status = "200" if stream else "499"
    assert statuses(stack).get(status, 0) == counted_before.get(status, 0) + 1
    assert "request.client_disconnected" in "\n".join(stack.log_lines()[lines:])
