"""The fault-load run's reading of answers: failures classified as a client sees them, and the
seams a resumed stream could show while it still succeeds."""

from __future__ import annotations

import json
from typing import Any

from load.faults.seams import (
    Event,
    Result,
    anthropic_events,
    failure,
    json_answer,
    openai_events,
    responses_events,
    seams,
)


def data(chunk: dict[str, Any]) -> Event:
    return (None, json.dumps(chunk))


def chat_chunk(text: str = "", role: bool = False, finish: str | None = None,
               chunk_id: str = "chatcmpl-1") -> Event:
    delta: dict[str, Any] = {"content": text}
    if role:
        delta["role"] = "assistant"
    return data({"id": chunk_id, "choices": [{"index": 0, "delta": delta,
                                               "finish_reason": finish}]})


def streamed(events: list[Event]) -> Result:
    return Result("chat-stream", "p", 0.0, 1.0, status=200, facts=openai_events(events, chat=True))


def test_a_whole_chat_stream_is_complete_and_has_no_seam() -> None:
    result = streamed([chat_chunk(role=True), chat_chunk("Hel"), chat_chunk("lo", finish="stop"),
                       (None, "[DONE]")])
    assert failure(result) is None
    assert result.facts is not None and result.facts.text == "Hello"
    assert seams(result, "Hello") == []


def test_a_resumed_stream_that_shows_its_seam_is_caught_each_way() -> None:
    second_role = streamed([chat_chunk(role=True), chat_chunk("Hel"), chat_chunk(role=True),
                            chat_chunk("lo", finish="stop")])
    assert seams(second_role, "Hello") == ["duplicated role"]
    second_id = streamed([chat_chunk("Hel", role=True),
                          chat_chunk("lo", finish="stop", chunk_id="chatcmpl-2")])
    assert seams(second_id, "Hello") == ["second id"]
    repeated = streamed([chat_chunk("Hel", role=True), chat_chunk("Hello", finish="stop")])
    assert seams(repeated, "Hello") == ["text discontinuity"]
    assert seams(repeated, None) == []  # no reference (it failed): the text is not judged


def test_failures_are_classified_as_the_client_saw_them() -> None:
    cut = streamed([chat_chunk("Hel", role=True)])  # no finish: the connection just ended
    assert failure(cut) == "broken stream" and seams(cut, "Hello") == []
    ended_on_error = streamed([chat_chunk("Hel", role=True),
                               data({"error": {"code": "engine_lost", "message": "x"}}),
                               (None, "[DONE]")])
    assert failure(ended_on_error) == "error event: engine_lost"
    assert failure(Result("chat", "p", 0.0, 1.0, status=503)) == "503"
    assert failure(Result("chat", "p", 0.0, 1.0, status=422)) == "http 422"
    assert failure(Result("chat", "p", 0.0, 1.0, transport="RemoteProtocolError")) == (
        "connection: RemoteProtocolError")
    assert failure(Result("chat", "p", 0.0, 1.0, status=200)) == "unreadable answer"


def test_responses_and_anthropic_streams_read_the_same_facts() -> None:
    responses = responses_events([
        ("response.created", json.dumps({"response": {"id": "resp_1"}})),
        ("response.output_text.delta", json.dumps({"delta": "Hi"})),
        ("response.completed", json.dumps({"response": {"id": "resp_1"}}))])
    assert (responses.text, responses.ids, responses.complete) == ("Hi", ["resp_1"], True)
    failed = responses_events([("error", json.dumps({"code": "engine_lost"})),
                               ("response.failed", json.dumps({"response": {"error": {}}}))])
    assert failed.errors[0] == "engine_lost" and not failed.complete
    messages = anthropic_events([
        ("message_start", json.dumps({"message": {"id": "msg_1"}})),
        ("content_block_delta", json.dumps({"delta": {"text": "Hi"}})),
        ("message_start", json.dumps({"message": {"id": "msg_2"}})),
        ("message_stop", json.dumps({}))])
    assert messages.roles == 2 and messages.ids == ["msg_1", "msg_2"] and messages.complete
    overloaded = anthropic_events([("error", json.dumps({"error": {"type": "overloaded_error"}}))])
    assert overloaded.errors == ["overloaded_error"]


def test_whole_answers_of_each_protocol_give_their_text() -> None:
    assert json_answer({"choices": [{"message": {"content": "a"}}]}, "chat").text == "a"
    assert json_answer({"choices": [{"text": "b"}]}, "completions").text == "b"
    assert json_answer({"output": [{"content": [{"text": "c"}]}]}, "responses").text == "c"
    assert json_answer({"content": [{"type": "text", "text": "d"}]}, "messages").text == "d"
