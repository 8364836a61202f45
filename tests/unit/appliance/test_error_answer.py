"""The one error writer: each error answer logged once, counted once, in the route's shape, on
each wire (ASGI, a Litestar response's parts, raw HTTP/1.1 at the edge)."""

from __future__ import annotations

import json
from typing import Any

import httptools
from structlog.testing import capture_logs

from appliance.answers.answer import error_answer
from appliance.apis.anthropic.api import ANTHROPIC
from appliance.apis.openai.api import OPENAI
from appliance.core.errors import (
    BadRequest,
    EngineUnavailable,
    HeadersTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    internal_error,
)


class Tally:
    def __init__(self) -> None:
        self.counted: list[tuple[str, str]] = []

    def error_answered(self, error: Any, route: str) -> None:
        self.counted.append((error.reason, route))


def parsed(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An HTTP/1.1 answer as a client reads it."""
    found: dict[str, Any] = {"headers": [], "body": b""}

    class Reader:
        def on_header(self, name: bytes, value: bytes) -> None:
            found["headers"].append((name.lower(), value))

        def on_body(self, body: bytes) -> None:
            found["body"] += body

    parser = httptools.HttpResponseParser(Reader())
    parser.feed_data(raw)
    return parser.get_status_code(), found["headers"], found["body"]


def test_a_refusal_is_logged_and_counted_once_in_the_routes_shape() -> None:
    tally = Tally()
    with capture_logs() as logs:
        answer = error_answer(BadRequest("no", param="n", code="n_cap"), ANTHROPIC, "rid", tally,
                              route="/v1/messages")
    assert tally.counted == [("n_cap", "/v1/messages")]
    assert [(e["event"], e["status"], e["reason"]) for e in logs] == [
        ("request.rejected", 400, "n_cap")]
    assert answer.status == 400 and answer.headers == {"x-request-id": "rid"}
    assert json.loads(answer.body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "no"}}


def test_a_bug_is_one_line_with_its_traceback_and_a_503_while_down_is_a_refusal() -> None:
    with capture_logs() as logs:
        error_answer(internal_error(KeyError("k")), OPENAI, "rid", Tally(), route="/x")
        error_answer(EngineUnavailable("down", retry_after_s=3), OPENAI, "rid", Tally())
    assert [e["event"] for e in logs] == ["request.unhandled_exception", "request.rejected"]
    assert isinstance(logs[0]["exc_info"], KeyError) and logs[0]["route"] == "/x"


def test_the_edges_answers_are_raw_http_that_close_the_connection_once() -> None:
    for error, status in ((HeadersTooLarge("big", code="too_many_headers"), 431),
                          (RequestTimeout("slow", code="header_timeout"), 408),
                          (ServiceUnavailable("full", code="over_capacity", retry_after_s=1), 503)):
        raw = error_answer(error, OPENAI, None, Tally(), peer=("10.0.0.9", 5)).http1()
        got, headers, body = parsed(raw)
        assert got == status
        assert [v for k, v in headers if k == b"connection"] == [b"close"]
        assert json.loads(body) == {"error": {"message": error.message, "type": error.kind,
                                              "param": None, "code": error.code}}
        if status == 503:
            assert (b"retry-after", b"1") in headers
