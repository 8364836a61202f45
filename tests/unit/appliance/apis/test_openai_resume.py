"""A chat or completions stream's record (appliance/apis/openai/resume.py over
appliance/recovery/stream.py), on events as vLLM 0.32 writes them (captured from the worker):
the client sees the worker's stream but the prompt's ids, the continuation carries prompt +
generated ids and what is left of the budget, and its events read as the same stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.apis.openai.resume import ChatRecord, CompletionRecord, plain_stream
from appliance.core.errors import UpstreamError
from appliance.recovery.stream import KEPT_BYTES, remaining
from tests.unit.appliance.recovery.test_text import GREEDY, Worker

pytestmark = pytest.mark.anyio

HEAD = b'"id":"chatcmpl-a9","object":"chat.completion.chunk","created":17,"model":"m"'
ROLE_IDS = (b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,9690,198],'
            b'"prompt_text":null}\n\n')
ROLE = ROLE_IDS.replace(b"[1,9690,198]", b"null")


def content(text: str, ids: bytes | None, finish: str | None = None) -> bytes:
    choice = b'{"index":0,"delta":{"content":' + json.dumps(text).encode() + b'},"logprobs":null,'
    choice += b'"finish_reason":' + (json.dumps(finish).encode() if finish else b"null")
    if finish:
        choice += b',"stop_reason":null'
    choice += b',"token_ids":' + (b"[" + ids + b"]" if ids is not None else b"null") + b"}"
    return b"data: {" + HEAD + b',"choices":[' + choice + b"]}\n\n"


HELD = (b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{},"logprobs":null,'
        b'"finish_reason":null,"token_ids":[226]}]}\n\n')  # a character not complete yet

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0,
        "seed": 3, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True}


def completion_event(text: str, ids: list[int], prompt: list[int] | None = None,
                     finish: str | None = None, cid: str = "cmpl-new", created: int = 99
                     ) -> bytes:
    event = {"id": cid, "object": "text_completion", "created": created, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                          "stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids}]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def test_the_client_gets_the_workers_stream_but_the_prompts_ids() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    assert record.take(ROLE_IDS) == ROLE
    assert record.take(content("Hello", b"19556")) == content("Hello", b"19556")
    assert record.take(HELD) == HELD
    split = content(" there", b"665")  # whole events only: a seam must never cut one
    assert record.take(split[:20]) == b"" and record.take(split[20:]) == split
    assert record.prompt_tokens == 3 and record.generated_tokens == 3
    assert record.resumable


def test_the_head_is_read_from_the_first_event_when_asked_and_a_broken_one_cannot_resume(
        ) -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556"))
    assert record.head is not None and record.head.id == "chatcmpl-a9"
    assert (record.head.created, record.head.model) == (17, "m")
    broken = ChatRecord(CHAT, ids_visible=False)
    broken.take(ROLE_IDS.replace(b'"created":17', b'"created":') + content("Hello", b"19556"))
    assert broken.head is None and not broken.resumable  # read when asked, no exception


def test_whole_events_pass_verbatim_once_the_first_is_read_and_keep_counts_as_take() -> None:
    """The relay's direct path writes a verbatim chunk itself and only appends it to `kept`: the
    record says when it may (never before the first event's prompt ids are cut, never while an
    event is cut in two), and what was kept so reads as what `take` would have."""
    kept, taken = ChatRecord(CHAT, ids_visible=False), ChatRecord(CHAT, ids_visible=False)
    for record in (kept, taken):
        assert not record.verbatim
        assert record.take(ROLE_IDS) == ROLE
        assert record.verbatim
    split = content(" there", b"665")
    for chunk in (content("Hello", b"19556"), split[:20], split[20:], HELD):
        assert taken.take(chunk) == (b"" if chunk == split[:20] else
                                     split if chunk == split[20:] else chunk)
        if kept.verbatim and chunk.endswith(b"\n\n"):
            kept.kept.append(chunk)  # as the relay does
            kept.kept_bytes += len(chunk)
        else:
            kept.take(chunk)
        assert kept.verbatim == (chunk != split[:20])
    assert kept.generated_tokens == taken.generated_tokens == 3
    assert kept.continuation() == taken.continuation()


def test_a_long_stream_is_read_for_its_ids_as_it_goes_not_kept_whole() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS)
    event = content("word", b"7")
    count = 3 * KEPT_BYTES // len(event)
    for _ in range(count):
        assert record.take(event) == event
        assert record.kept_bytes == sum(map(len, record.kept)) <= KEPT_BYTES  # the bound
    record.take(HELD)  # its id is not the client's yet: the continuation starts before it
    assert record.generated_tokens == count + 1
    body = json.loads(record.continuation().body or b"")
    assert body["prompt"] == [1, 9690, 198, *[7] * count]


def test_a_client_that_asked_for_the_ids_keeps_them() -> None:
    record = ChatRecord(CHAT, ids_visible=True)
    assert record.take(ROLE_IDS + content("Hi", b"5")) == ROLE_IDS + content("Hi", b"5")
    assert record.take(HELD) == HELD
    assert record.generated_tokens == 2


def test_the_continuation_starts_after_the_last_id_the_client_has_text_for() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556") + content(" there", b"665,28") + HELD)
    continuation = record.continuation()
    body = json.loads(continuation.body or b"")
    assert continuation.target == "/v1/completions"
    assert body["prompt"] == [1, 9690, 198, 19556, 665, 28]  # not 226: its text never went out
    assert body["max_tokens"] == 7 and body["temperature"] == 0 and body["seed"] == 3
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True and "messages" not in body


def test_the_continuation_reads_as_the_same_chat_stream() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556"))
    record.continuation()
    first = record.take(completion_event(" there", [665], prompt=[1, 9690, 198, 19556]))
    assert first == content(" there", b"665")
    last = completion_event("", [2], finish="stop")
    assert record.take(last) == content("", b"2", finish="stop")
    usage = {"id": "cmpl-new", "object": "text_completion", "created": 99, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 5, "total_tokens": 7,
                                      "completion_tokens": 2}, "system_fingerprint": "fp"}
    out = record.take(b"data: " + json.dumps(usage).encode() + b"\n\n")
    assert json.loads(out.removeprefix(b"data: ")) == {
        "id": "chatcmpl-a9", "object": "chat.completion.chunk", "created": 17, "model": "m",
        "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
        "system_fingerprint": "fp"}
    assert record.take(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert record.finished and not record.resumable


def test_the_ids_of_a_character_the_client_had_when_the_engine_died_come_once() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556") + HELD)  # 226: a character's first part
    assert json.loads(record.continuation().body or b"")["prompt"] == [1, 9690, 198, 19556]
    assert record.take(completion_event("", [226], prompt=[1, 9690, 198, 19556])) == b""
    after = json.loads(record.take(completion_event("é", [227])).removeprefix(b"data: "))
    assert after == json.loads(content("é", b"227").removeprefix(b"data: "))
    assert record.generated_tokens == 3  # 19556, 226, 227: the ids the client saw, once each


def test_a_second_fault_continues_from_the_continuations_ids() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556"))
    record.continuation()
    record.take(completion_event(" there", [665], prompt=[1, 9690, 198, 19556]))
    again = json.loads(record.continuation().body or b"")
    assert again["prompt"] == [1, 9690, 198, 19556, 665] and again["max_tokens"] == 8


def test_a_completions_stream_keeps_its_id_across_the_seam() -> None:
    body = {"prompt": "Once upon", "max_tokens": 4, "stream": True, "return_token_ids": True}
    record = CompletionRecord(body, ids_visible=False)
    out = record.take(completion_event(" the", [260], prompt=[6403, 1980], cid="cmpl-old",
                                       created=5))
    assert json.loads(out.removeprefix(b"data: "))["choices"][0] == {
        "index": 0, "text": " the", "logprobs": None, "finish_reason": None,
        "stop_reason": None, "prompt_token_ids": None, "token_ids": [260]}
    assert json.loads(record.continuation().body or b"")["prompt"] == [6403, 1980, 260]
    later = json.loads(record.take(completion_event(" end", [9], prompt=[6403, 1980, 260]))
                       .removeprefix(b"data: "))
    assert (later["id"], later["created"]) == ("cmpl-old", 5)
    assert later["choices"][0]["prompt_token_ids"] is None and later["choices"][0]["text"] == " end"


def test_a_stream_whose_last_token_came_ends_without_a_continuation() -> None:
    record = ChatRecord(CHAT, ids_visible=False)
    record.take(ROLE_IDS + content("Hi", b"5", finish="length"))
    assert record.finished and not record.resumable
    usage = json.loads(record.tail().split(b"\n\n")[0].removeprefix(b"data: "))
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert record.tail().endswith(b"data: [DONE]\n\n")


def test_a_record_without_its_first_event_cannot_resume() -> None:
    assert not ChatRecord(CHAT, ids_visible=False).resumable


def test_streams_whose_state_is_more_than_their_tokens_do_not_resume() -> None:
    plain: dict[str, Any] = {"stream": True}
    assert plain_stream(plain) and plain_stream(plain | {"stop": None, "n": 1, "logprobs": False})
    for extra in ({"stop": ["\n"]}, {"n": 2}, {"logprobs": True}, {"top_logprobs": 2},
                  {"structured_outputs": {"regex": "a+"}}, {"tools": [{"type": "function"}]},
                  {"response_format": {"type": "json_object"}}, {"echo": True},
                  {"stream_options": {"continuous_usage_stats": True}}, {"stream": False}):
        assert not plain_stream(plain | extra), extra


# --- however the reads cut the stream ----------------------------------------------------------
# After its first event a stream's events are kept a whole read at a time, read for their ids
# later; these check that every way of cutting the worker's bytes into reads gives the client the
# same bytes and leaves the record where one event at a time leaves it.

USAGE = (b"data: {" + HEAD + b',"choices":[],"usage":{"prompt_tokens":3,"total_tokens":9,'
         b'"completion_tokens":6}}\n\n')
DONE = b"data: [DONE]\n\n"


def reads(events: list[bytes]) -> list[list[bytes]]:
    """Every way of cutting the events' bytes into reads: at event boundaries (each subset of
    them), and at each byte in two reads."""
    cuts: list[list[bytes]] = []
    for mask in range(2 ** (len(events) - 1)):
        groups, group = [], events[0]
        for i, event in enumerate(events[1:]):
            if mask >> i & 1:
                groups.append(group)
                group = event
            else:
                group += event
        cuts.append([*groups, group])
    whole = b"".join(events)
    cuts += [[whole[:at], whole[at:]] for at in range(1, len(whole))]
    return cuts


def fed(record: ChatRecord | CompletionRecord, chunks: list[bytes]) -> bytes:
    return b"".join(record.take(chunk) for chunk in chunks)


def test_every_cut_of_a_chat_stream_reaches_the_client_the_same() -> None:
    events = [ROLE_IDS, content("Hello", b"19556"), content(" there", b"665,28"), HELD,
              content("é", b"227"), content("", b""), content("!", b"0", finish="length"),
              USAGE, DONE]
    expected = ROLE + b"".join(events[1:])
    for chunks in reads(events):
        record = ChatRecord(CHAT, ids_visible=False)
        assert fed(record, chunks) == expected, chunks
        assert record.finished and record.generated_tokens == 6
        visible = ChatRecord(CHAT, ids_visible=True)
        assert fed(visible, chunks) == b"".join(events)
        assert visible.generated_tokens == 6


def test_every_cut_of_a_chat_stream_continues_after_the_last_text() -> None:
    events = [ROLE_IDS, content("Hello", b"19556"), HELD, content("é", b"227"),
              content(" there", b"665,28"), HELD]
    for chunks in reads(events):
        record = ChatRecord(CHAT, ids_visible=False)
        assert fed(record, chunks) == ROLE + b"".join(events[1:])
        body = json.loads(record.continuation().body or b"")
        assert body["prompt"] == [1, 9690, 198, 19556, 226, 227, 665, 28], chunks
        assert body["max_tokens"] == 5


def test_every_cut_of_a_completions_stream_reaches_the_client_the_same() -> None:
    body = {"prompt": "Once upon", "max_tokens": 6, "stream": True}
    events = [completion_event(" a", [264], prompt=[6403, 1980]), completion_event(" time", [892]),
              completion_event("", [226]), completion_event("é", [227]),
              completion_event(" there", [665, 28], finish="length"), DONE]
    expected = _without_prompt_ids(events[0]) + b"".join(events[1:])
    for chunks in reads(events):
        record = CompletionRecord(body, ids_visible=False)
        assert fed(record, chunks) == expected, chunks
        assert record.finished and record.generated_tokens == 6
    held = CompletionRecord(body, ids_visible=False)
    fed(held, [b"".join(events[:3])])  # the client has " time" and an empty text event
    assert json.loads(held.continuation().body or b"")["prompt"] == [6403, 1980, 264, 892]


def _without_prompt_ids(event: bytes) -> bytes:
    """A completions event with the prompt's ids as the worker writes it when not asked."""
    data = json.loads(event.removeprefix(b"data: "))
    data["choices"][0]["prompt_token_ids"] = None
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


# --- the budget a continuation carries -----------------------------------------------------------
# vLLM's completions route, where every continuation goes, takes 16 tokens when it is given no
# budget: a continuation carries what is left of the budget its request resolved to.

NO_BUDGET = {k: v for k, v in CHAT.items() if k != "max_tokens"}


async def test_a_chat_stream_sent_without_a_budget_continues_with_the_rest_of_its_room() -> None:
    """The worker resolved the budget (the room the prompt left) when it generated: the new
    one renders the body as it was sent and the continuation carries what is left of it."""
    record = ChatRecord(NO_BUDGET, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556") + content(" there", b"665"))
    worker = Worker([1, 9690, 198], GREEDY | {"max_tokens": 2045}, tokens=[])
    await record.prepare(worker)
    assert worker.asked == [("/v1/chat/completions/render", NO_BUDGET)]
    body = json.loads(record.continuation().body or b"")
    assert body["max_tokens"] == 2043 and "min_tokens" not in body
    record.take(completion_event(" you", [346], prompt=[1, 9690, 198, 19556, 665]))
    await record.prepare(worker)  # a second fault: the budget is the same, not rendered again
    assert len(worker.asked) == 1
    assert json.loads(record.continuation().body or b"")["max_tokens"] == 2042


async def test_a_completions_stream_without_a_budget_continues_with_the_rest_of_its_16() -> None:
    body = {"prompt": "Once upon", "stream": True, "return_token_ids": True}
    record = CompletionRecord(body, ids_visible=False)
    record.take(completion_event(" a", [264], prompt=[6403, 1980]) + completion_event(" time", [892]))
    worker = Worker([6403, 1980], GREEDY | {"max_tokens": 16}, tokens=[])
    await record.prepare(worker)  # vLLM answers this route with a list, one per prompt
    assert worker.asked == [("/v1/completions/render", body)]
    assert json.loads(record.continuation().body or b"")["max_tokens"] == 14


async def test_a_budget_in_the_body_is_the_one_continued_and_no_render_is_asked() -> None:
    """The client's, the gate's configured default or its clamp: the first field vLLM obeys."""
    for budget, expected in (({"max_tokens": 10}, 8),
                             ({"max_completion_tokens": 12, "max_tokens": 10}, 10),
                             ({"max_completion_tokens": None, "max_tokens": 10}, 8)):
        record = ChatRecord(NO_BUDGET | budget, ids_visible=False)
        record.take(ROLE_IDS + content("Hello", b"19556") + content(" there", b"665"))
        worker = Worker([], GREEDY, tokens=[])
        await record.prepare(worker)
        assert worker.asked == []
        assert json.loads(record.continuation().body or b"")["max_tokens"] == expected, budget


async def test_min_tokens_counts_what_was_generated_within_the_rest_of_the_budget() -> None:
    """A minimum the worker would refuse next to the budget's default (finding: `min_tokens must
    be less than or equal to max_tokens=16`) is now less what came, under what is left."""
    record = ChatRecord(NO_BUDGET | {"min_tokens": 120}, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556") + content(" there", b"665"))
    await record.prepare(Worker([1, 9690, 198], GREEDY | {"max_tokens": 300}, tokens=[]))
    body = json.loads(record.continuation().body or b"")
    assert (body["max_tokens"], body["min_tokens"]) == (298, 118)
    assert remaining(10, 30, 4) == {"max_tokens": 6, "min_tokens": 6}  # never above the rest
    assert remaining(10, 3, 4) == {"max_tokens": 6}  # met already: none
    assert remaining(10, None, 12) == {"max_tokens": 1}


async def test_a_refused_render_is_the_workers_error() -> None:
    record = ChatRecord(NO_BUDGET, ids_visible=False)
    record.take(ROLE_IDS + content("Hello", b"19556"))
    with pytest.raises(UpstreamError) as refused:
        await record.prepare(Worker([], GREEDY, tokens=[], status=400))
    assert refused.value.status == 400
