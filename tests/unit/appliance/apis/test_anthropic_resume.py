"""An Anthropic Messages stream's record (appliance/apis/anthropic/resume.py): cut anywhere in
a stream vLLM 0.32 wrote (captured from the worker), its continuation's events read byte for
byte as the rest of that stream: the same text block, then its end with the stop reason and the
whole answer's usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.apis.anthropic.api import MESSAGES
from appliance.apis.anthropic.resume import MessagesRecord, plain_message
from appliance.core.sections import EngineSettings
from appliance.core.settings import Settings
from tests.unit.appliance.recovery.test_text import GREEDY, Worker, captured, completion

pytestmark = pytest.mark.anyio

STREAM = captured("vllm_messages_stream.sse")  # message and block start, 40 deltas, 3 ends
DELTAS = STREAM[2:42]
PROMPT = list(range(200, 241))  # 41 ids, as the captured render's
BODY = {"model": "m", "max_tokens": 40, "temperature": 0, "stream": True,
        "messages": [{"role": "user",
                      "content": "Write a story about a lighthouse keeper and a storm."}]}


def text_of(event: bytes) -> str:
    return str(json.loads(event.split(b"data: ", 1)[1])["delta"]["text"])


def rest_of(first: int, finish: str = "length") -> list[bytes]:
    events = [completion(text_of(d), [9], finish if d is DELTAS[-1] else None)
              for d in DELTAS[first:]]
    return [*events, b"data: [DONE]\n\n"]


async def resumed(cut: int, continued: list[bytes]) -> tuple[MessagesRecord, bytes]:
    record = MessagesRecord(BODY)
    assert b"".join(record.take(event) for event in STREAM[:cut]) == b"".join(STREAM[:cut])
    assert record.resumable
    worker = Worker(PROMPT, GREEDY, tokens=[7] * max(0, cut - 2))
    await record.prepare(worker)
    assert worker.asked[0] == ("/v1/messages/render", BODY)
    record.continuation()
    return record, b"".join(record.take(event) for event in continued)


@pytest.mark.parametrize("cut", [1, 2, 12, 41])
async def test_the_continuation_reads_as_the_rest_of_the_workers_own_stream(cut: int) -> None:
    record, given = await resumed(cut, rest_of(max(0, cut - 2)))
    assert given == b"".join(STREAM[cut:])  # block opened if it was not, the same end, usage
    assert record.finished and not record.resumable


async def test_a_stop_is_the_end_of_the_turn() -> None:
    _, given = await resumed(12, rest_of(10, finish="stop"))
    delta = json.loads(given.split(b"event: message_delta\ndata: ")[1].split(b"\n")[0])
    assert delta == {"type": "message_delta",
                     "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                     "usage": {"input_tokens": 41, "output_tokens": 40}}


def test_a_stream_whose_end_was_under_way_or_done_does_not_resume() -> None:
    closing = MessagesRecord(BODY)
    for event in STREAM[:43]:  # content_block_stop went out
        closing.take(event)
    assert not closing.resumable and not closing.finished
    done = MessagesRecord(BODY)
    for event in STREAM:
        done.take(event)
    assert done.finished and done.tail() == b""


def test_a_stream_with_a_thinking_block_or_an_error_does_not_resume() -> None:
    thinking = MessagesRecord(BODY)
    thinking.take(STREAM[0])
    thinking.take(b'event: content_block_start\ndata: {"type":"content_block_start",'
                  b'"content_block":{"type":"thinking","thinking":""},"index":0}\n\n')
    assert not thinking.resumable
    failed = MessagesRecord(BODY)
    failed.take(STREAM[0])
    failed.take(b'event: error\ndata: {"type":"error","error":{"type":"internal_error",'
                b'"message":"x"}}\n\n')
    assert not failed.resumable


@pytest.mark.parametrize("extra", [
    {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    {"stop_sequences": ["."]}, {"thinking": {"type": "enabled", "budget_tokens": 100}},
    {"output_config": {"format": {"type": "json_schema", "json_schema": {}}}},
    {"stream": False},
])
def test_bodies_whose_answer_is_more_than_its_text_do_not_resume(extra: dict[str, Any]) -> None:
    assert plain_message(BODY) and not plain_message(BODY | extra)
    assert MESSAGES.stream_record(BODY | extra, Settings()) is None


def test_a_plain_body_gets_a_record_that_asks_for_no_token_ids() -> None:
    record = MESSAGES.stream_record(BODY | {"thinking": {"type": "disabled"}}, Settings())
    assert isinstance(record, MessagesRecord) and not record.token_ids
    parsed = Settings(engine=EngineSettings(reasoning_parser="deepseek_r1"))
    assert MESSAGES.stream_record(BODY, parsed) is None
