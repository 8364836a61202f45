"""Idle connections (issue 9 #4): a connection with no request in progress, fresh or kept
alive, is closed after the idle timeout; one busy with a long answer is not."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from load.kit.rawclient import Conn, Stalled, json_request, request_head
from tests.support.stack import Stack
from tests.unit.appliance.edge.conftest import boot
from tests.unit.appliance.edge.limits import CUT_OFF_S, FD_SLACK, PHASE_TIMEOUT_S

SILENT = 200
TOKEN_DELAY_S = 0.5
TOKENS = 8  # a stream of TOKENS * TOKEN_DELAY_S = 4 s, twice the idle timeout


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    slow_worker = ("--tokens", str(TOKENS), "--token-delay", str(TOKEN_DELAY_S))
    with boot(tmp_path_factory, upstream_args=slow_worker) as running:
        yield running


def _hung_up_within(conn: Conn, seconds: float) -> bool:
    try:
        return conn.reply(max(0.02, seconds)).hung_up
    except Stalled:
        return False


def test_silent_connections_are_closed_after_the_idle_timeout(stack: Stack) -> None:
    """#4: 200 connections that never send a byte are all closed within the idle timeout
    (+ slack), and the appliance's descriptors return to where they were."""
    before = stack.usage()
    started = time.monotonic()
    with contextlib.ExitStack() as opened:
        conns = [opened.enter_context(Conn(stack.target)) for _ in range(SILENT)]
        held = sum(not _hung_up_within(c, started + CUT_OFF_S - time.monotonic()) for c in conns)
        assert held == 0, f"{held} of {SILENT} silent connections still open after {CUT_OFF_S}s"
        after = stack.usage()
    assert after.fds <= before.fds + FD_SLACK, f"fds {before.fds} -> {after.fds}"


def test_a_kept_alive_connection_is_closed_after_the_idle_timeout(stack: Stack) -> None:
    """#4: after a served request, a connection left idle is closed within the idle timeout."""
    with Conn(stack.target) as conn:
        assert conn.send(request_head("GET", "/livez", stack.target))
        assert conn.reply(10).status == 200
        assert _hung_up_within(conn, CUT_OFF_S), f"still open {CUT_OFF_S}s after its answer"


def test_a_long_stream_is_not_cut_off_by_the_idle_timeout(stack: Stack) -> None:
    """Guard: a stream that runs twice the idle timeout, a token every 0.5 s, ends in [DONE]."""
    assert TOKENS * TOKEN_DELAY_S >= 2 * PHASE_TIMEOUT_S
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    with Conn(stack.target) as conn:
        assert conn.send(json_request("POST", "/v1/chat/completions", stack.target, body))
        reply = conn.reply(TOKENS * TOKEN_DELAY_S + 10)
    assert reply.status == 200
    assert reply.body.rstrip().endswith(b"data: [DONE]")
