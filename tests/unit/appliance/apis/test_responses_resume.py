"""A Responses stream's record (appliance/apis/responses/resume.py): cut anywhere in a stream
vLLM 0.32 wrote (captured from the worker), its continuation's events read byte for byte as the
rest of that stream: the same item, numbered on, its end with the whole text, status and usage."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from appliance.apis.responses.api import RESPONSES_CREATE
from appliance.apis.responses.resume import ResponsesRecord, plain_response
from appliance.core.sections import EngineSettings
from appliance.core.settings import Settings
from tests.unit.appliance.recovery.test_text import BODY, GREEDY, PROMPT, Worker, captured, completion

pytestmark = pytest.mark.anyio

STREAM = captured("vllm_responses_stream.sse")  # 4 head events, 40 deltas of a token, 4 ends
DELTAS = STREAM[4:44]


def text_of(event: bytes) -> str:
    return str(json.loads(event.split(b"data: ", 1)[1])["delta"])


async def resumed(cut: int, continued: list[bytes], params: dict[str, Any] = GREEDY,
                  sent_tokens: int | None = None) -> tuple[ResponsesRecord, bytes]:
    """The record after the worker's first `cut` events, continued by `continued`: what the
    client gets of the continuation."""
    record = ResponsesRecord(BODY)
    assert b"".join(record.take(event) for event in STREAM[:cut]) == b"".join(STREAM[:cut])
    assert record.resumable
    sent = max(0, cut - 4) if sent_tokens is None else sent_tokens
    await record.prepare(Worker(PROMPT, params, tokens=[7] * sent))
    record.continuation()
    return record, b"".join(record.take(event) for event in continued)


def rest_of(first: int, finish: str = "length") -> list[bytes]:
    """The continuation of the captured answer after its first `first` deltas, a token each."""
    events = [completion(text_of(d), [9], finish if d is DELTAS[-1] else None)
              for d in DELTAS[first:]]
    return [*events, b"data: [DONE]\n\n"]


@pytest.mark.parametrize("cut", [5, 14, 43])
async def test_the_continuation_reads_as_the_rest_of_the_workers_own_stream(cut: int) -> None:
    record, given = await resumed(cut, rest_of(cut - 4))
    assert given == b"".join(STREAM[cut:])  # same item id, numbers, text, status and usage
    assert record.finished and not record.resumable


async def test_a_stream_lost_before_its_first_text_opens_its_message_item() -> None:
    _, given = await resumed(2, rest_of(0))
    ours, theirs = (re.search(rb'"id":"(msg_[0-9a-f]{16})"', b) for b in (given, STREAM[2]))
    assert ours is not None and theirs is not None  # an id in vLLM's own form
    assert given.replace(ours.group(1), theirs.group(1)) == b"".join(STREAM[2:])


async def test_a_second_fault_continues_from_all_the_text_sent() -> None:
    record, given = await resumed(10, rest_of(6)[:5])  # 6 deltas, then 5 more, then lost
    assert given == b"".join(STREAM[10:15]) and record.resumable
    worker = Worker(PROMPT, GREEDY, tokens=[7] * 11)
    await record.prepare(worker)
    assert worker.asked[1][1]["prompt"] == "".join(map(text_of, DELTAS[:11]))
    assert json.loads(record.continuation().body or b"")["max_tokens"] == 29
    assert b"".join(record.take(event) for event in rest_of(11)) == b"".join(STREAM[15:])


async def test_a_stop_completes_the_response() -> None:
    _, given = await resumed(14, rest_of(10, finish="stop"))
    completed = json.loads(given.rsplit(b"data: ", 1)[1])
    assert completed["type"] == "response.completed"
    response = completed["response"]
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["usage"]["output_tokens"] == 40 and response["usage"]["input_tokens"] == 37


async def test_the_usage_counts_the_sent_text_as_tokenized_again() -> None:
    _, given = await resumed(14, rest_of(10), sent_tokens=9)  # 10 tokens sent, 9 once tokenized
    usage = json.loads(given.rsplit(b"data: ", 1)[1])["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (37, 39, 76)


def test_a_stream_whose_end_was_under_way_or_done_does_not_resume() -> None:
    closing = ResponsesRecord(BODY)
    for event in STREAM[:45]:  # output_text.done went out
        closing.take(event)
    assert not closing.resumable and not closing.finished
    done = ResponsesRecord(BODY)
    for event in STREAM:
        done.take(event)
    assert done.finished and done.tail() == b""


def test_a_stream_lost_before_its_first_event_or_with_other_items_does_not_resume() -> None:
    assert not ResponsesRecord(BODY).resumable
    reasoning = ResponsesRecord(BODY)
    for event in STREAM[:2]:
        reasoning.take(event)
    reasoning.take(b'event: response.output_item.added\ndata: {"item":{"id":"rs_1","summary":[],'
                   b'"type":"reasoning","status":"in_progress"},"output_index":0,'
                   b'"sequence_number":2,"type":"response.output_item.added"}\n\n')
    assert not reasoning.resumable


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
    {"previous_response_id": "resp_1"}, {"background": True}, {"stop": ["."]},
    {"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2},
    {"text": {"format": {"type": "json_object"}}}, {"enable_response_messages": True},
    {"stream": False},
])
def test_bodies_whose_answer_is_more_than_its_text_do_not_resume(extra: dict[str, Any]) -> None:
    assert plain_response(BODY) and not plain_response(BODY | extra)
    assert RESPONSES_CREATE.stream_record(BODY | extra, Settings()) is None


def test_a_plain_body_gets_a_record_that_asks_for_no_token_ids() -> None:
    record = RESPONSES_CREATE.stream_record(BODY | {"text": {"format": {"type": "text"}}},
                                            Settings())
    assert isinstance(record, ResponsesRecord) and not record.token_ids
    parsed = Settings(engine=EngineSettings(reasoning_parser="deepseek_r1"))
    assert RESPONSES_CREATE.stream_record(BODY, parsed) is None
