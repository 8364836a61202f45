"""The connection cap (issue 9 #4): beyond server.max_connections a new connection is refused
(a hang-up, or 503/429 to its request) and counted in a metric; the cap frees as they close."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import httpx
import pytest

from load.kit.rawclient import Conn, Stalled, request_head
from tests.support.stack import Stack
from tests.unit.appliance.edge.conftest import boot
from tests.unit.appliance.edge.limits import QUICK_S

CAP = 32
EXTRA = 16
CONNECTION_METRIC = re.compile(r"appliance_\w*connection\w*_total$")  # a counter; name: the fix's


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The idle timeout is long here, so that it is the cap, not the timeout, that acts.
    with boot(tmp_path_factory, server__max_connections=CAP, server__idle_timeout_s=60,
              server__header_timeout_s=60) as running:
        yield running


def _connection_counts(stack: Stack) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {key: value for key, value in stack.metrics().items()
            if CONNECTION_METRIC.match(key[0])}


def _refused(stack: Stack, conn: Conn) -> bool:
    """A GET /livez on this connection is refused: a hang-up, or a 503/429 answer."""
    try:
        if not conn.send(request_head("GET", "/livez", stack.target)):
            return True
        return conn.reply(QUICK_S).status in (None, 503, 429)
    except Stalled:
        return False  # held open, unanswered: neither served nor refused


def test_connections_beyond_the_cap_are_refused_and_counted(stack: Stack) -> None:
    """#4: with CAP connections held open, each of EXTRA more is refused, a metric counts the
    refusals, and once the held ones close an honest request is served again."""
    before = _connection_counts(stack)
    with contextlib.ExitStack() as opened:
        for _ in range(CAP):
            opened.enter_context(Conn(stack.target))
        extras = [opened.enter_context(Conn(stack.target)) for _ in range(EXTRA)]
        refused = sum(_refused(stack, conn) for conn in extras)
    assert refused == EXTRA, f"only {refused} of {EXTRA} connections over the cap were refused"
    after = _connection_counts(stack)
    grew = [key for key, value in after.items() if value >= before.get(key, 0.0) + 1]
    assert grew, f"no appliance_*connection* metric counted the refusals: {sorted(after)}"
    assert httpx.get(f"{stack.url}/livez", timeout=QUICK_S).status_code == 200
