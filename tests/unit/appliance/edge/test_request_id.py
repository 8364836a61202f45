"""Request ids (issue 9 #3, #10): a short id of [A-Za-z0-9._-] is echoed, passed to the worker
(it becomes the completion id) and logged; anything else is replaced, never echoed."""

from __future__ import annotations

import json
import re

import pytest

from load.kit.procstat import MIB
from load.kit.rawclient import Conn, Reply, json_request
from tests.support.stack import Stack
from tests.unit.appliance.edge.limits import QUICK_S

VALID = re.compile(r"[A-Za-z0-9._-]{1,128}")
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def _chat_with_id(stack: Stack, request_id: bytes) -> Reply:
    raw = json_request("POST", "/v1/chat/completions", stack.target, BODY,
                       [("X-Request-Id", request_id)])
    with Conn(stack.target, timeout_s=QUICK_S) as conn:
        conn.send(raw)
        return conn.reply(QUICK_S)


def _assert_replaced(reply: Reply, sent: bytes) -> None:
    """Served, under an id of the appliance's own that is valid and is the completion's id."""
    assert reply.status == 200, reply.body[:300]
    echoed = reply.headers.get("x-request-id", "")
    was_echoed = echoed.encode("latin-1") == sent
    assert not was_echoed, f"the invalid request id ({len(sent)} bytes) was echoed back"
    assert VALID.fullmatch(echoed), f"the id given instead is not short and plain: {echoed[:80]!r}"
    completion_id = json.loads(reply.body)["id"]
    assert echoed in completion_id, (echoed[:80], completion_id[:80])


def test_a_valid_request_id_is_echoed_passed_on_and_logged(stack: Stack) -> None:
    """#3: a short [A-Za-z0-9._-] id comes back, is the completion's id, and tags the log."""
    sent = "edge-test.Req_42"
    reply = _chat_with_id(stack, sent.encode())
    assert reply.status == 200
    assert reply.headers["x-request-id"] == sent
    assert json.loads(reply.body)["id"].endswith(sent)
    assert stack.wait_for_event(lambda event: event.get("request_id") == sent) is not None


def test_an_overlong_request_id_is_replaced_not_echoed(stack: Stack) -> None:
    """#3: a 4 KiB id of valid characters is over the cap: replaced, not echoed or forwarded."""
    sent = b"a" * 4096
    _assert_replaced(_chat_with_id(stack, sent), sent)


def test_a_one_mib_request_id_is_refused_or_replaced(stack: Stack) -> None:
    """#3: a 1 MiB X-Request-Id is refused with the header limit (431, hang-up) or replaced."""
    sent = b"b" * MIB
    reply = _chat_with_id(stack, sent)
    if reply.status in (None, 431):
        return
    _assert_replaced(reply, sent)


def test_a_non_ascii_request_id_is_replaced_consistently(stack: Stack) -> None:
    """#3/#10: a UTF-8 id is replaced by one plain id, the same in the header and completion."""
    sent = "réq-ünïcode-✓".encode()
    _assert_replaced(_chat_with_id(stack, sent), sent)


@pytest.mark.parametrize("sent", [b"ab\x01cd", b"ab\x7fcd", b"ab\tcd", b"ab;cd=1", b"ab cd"])
def test_a_request_id_outside_the_charset_is_not_echoed(stack: Stack, sent: bytes) -> None:
    """#3: control characters, blanks or punctuation outside [A-Za-z0-9._-]: a 400 from the
    HTTP parser, or the request served under an id of the appliance's own; never echoed."""
    reply = _chat_with_id(stack, sent)
    if reply.status == 400:
        was_echoed = reply.headers.get("x-request-id", "").encode("latin-1") == sent
        assert not was_echoed
        return
    _assert_replaced(reply, sent)
