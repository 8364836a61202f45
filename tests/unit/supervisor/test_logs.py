"""The log line: JSON with the time, the level and the request's fields; secrets masked."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import structlog

from appliance.core.context import CLIENT_NAME, REQUEST_ID_VAR, TRACE_ID_VAR
from appliance.core.sections import LoggingSettings
from supervisor.observe import logs


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logs.configure(LoggingSettings(format="json"), stream)
    yield stream
    structlog.reset_defaults()


def logged(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_has_the_utc_time_to_the_microsecond_the_level_and_the_request_fields(
        lines: io.StringIO) -> None:
    tokens = (REQUEST_ID_VAR.set("req-1"), TRACE_ID_VAR.set("a" * 32), CLIENT_NAME.set("team-a"))
    try:
        before = time.time()
        structlog.get_logger("t").info("request.completed", status=200, api_key="sk-secret")
        after = time.time()
    finally:
        CLIENT_NAME.reset(tokens[2])
        TRACE_ID_VAR.reset(tokens[1])
        REQUEST_ID_VAR.reset(tokens[0])
    structlog.get_logger("t").info("outside")
    inside, outside = logged(lines)
    assert inside["event"] == "request.completed" and inside["level"] == "info"
    assert (inside["request_id"], inside["trace_id"], inside["client"]) == ("req-1", "a" * 32,
                                                                           "team-a")
    assert inside["api_key"] == "***"
    stamp = str(inside["timestamp"])
    assert stamp.endswith("Z") and len(stamp.split(".")[1]) == 7  # six digits, then Z
    at = datetime.fromisoformat(stamp)
    assert at.tzinfo is not None and at.utcoffset() == UTC.utcoffset(at)
    assert before - 1e-6 <= at.timestamp() <= after + 1e-6
    assert not {"request_id", "trace_id", "client"} & outside.keys()


def test_a_field_the_line_names_itself_wins_over_the_request_s(lines: io.StringIO) -> None:
    token = CLIENT_NAME.set("team-a")
    try:
        structlog.get_logger("t").info("x", client="other")
    finally:
        CLIENT_NAME.reset(token)
    assert logged(lines)[0]["client"] == "other"


def test_the_time_of_day_is_right_across_seconds(lines: io.StringIO,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The date and time are formatted once a second: each line still gets its own."""
    for now in (1_790_000_000.25, 1_790_000_000.75, 1_790_000_001.5, 1_700_000_000.0):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        structlog.get_logger("t").info("x")
    stamps = [str(line["timestamp"]) for line in logged(lines)]
    assert stamps == [datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                      for now in (1_790_000_000.25, 1_790_000_000.75, 1_790_000_001.5,
                                  1_700_000_000.0)]
