"""Counting a request's tokens from the worker's usage, without changing what the client gets."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.admission.usage import Meter
from tests.unit.appliance.admission.vllm_streams import (
    CHAT_PLAIN,
    CHAT_TOKENS,
    CHAT_USAGE,
    COMPLETION_PLAIN,
    COMPLETION_TOKENS,
    COMPLETION_USAGE,
)

RECORDED = [(CHAT_PLAIN, CHAT_USAGE, CHAT_TOKENS),
            (COMPLETION_PLAIN, COMPLETION_USAGE, COMPLETION_TOKENS)]


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def relay(meter: Meter, chunks: list[bytes], strip: bool) -> list[bytes]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[bytes]:
        return [chunk async for chunk in meter.tap(source(), strip=strip)]

    return asyncio.run(collect())


@pytest.mark.parametrize(("plain", "with_usage", "tokens"), RECORDED)
def test_usage_asked_for_the_meter_is_taken_out_and_the_stream_is_as_vllm_sends_it_plain(
        plain: bytes, with_usage: bytes, tokens: int) -> None:
    meter = sent(prompt_bytes=4000)
    assert b"".join(relay(meter, [with_usage], strip=True)) == plain
    assert meter.tokens() == tokens


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(RECORDED), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_of_the_stream_into_chunks_gives_the_same_bytes_and_count(
        recorded: tuple[bytes, bytes, int], cuts: list[int]) -> None:
    plain, with_usage, tokens = recorded
    stripped = sent()
    assert b"".join(relay(stripped, pieces(with_usage, cuts), strip=True)) == plain
    kept = sent()
    assert b"".join(relay(kept, pieces(with_usage, cuts), strip=False)) == with_usage
    assert stripped.tokens() == kept.tokens() == tokens


def test_usage_the_client_asked_for_is_passed_on_untouched() -> None:
    meter = Meter(True)
    assert b"".join(relay(meter, pieces(CHAT_USAGE, [40, 300, 700]), strip=False)) == CHAT_USAGE
    assert meter.reported == CHAT_TOKENS


def test_whole_events_without_usage_pass_through_as_the_same_chunks() -> None:
    """The common case costs two substring searches: nothing is split or copied."""
    events = [event + b"\n\n" for event in CHAT_PLAIN.split(b"\n\n")[:-1]]
    without_finish = [e for e in events if b'"finish_reason":"' not in e]
    meter = Meter(True)
    assert relay(meter, without_finish, strip=True) == without_finish
    assert meter.reported is None


def test_an_unmetered_request_gets_the_very_iterator_back() -> None:
    async def source() -> AsyncIterator[bytes]:
        yield b""

    chunks = source()
    assert Meter(False).tap(chunks, strip=True) is chunks


def sent(prompt_bytes: int = 0, counted: int | None = None) -> Meter:
    meter = Meter(True, prompt_bytes=prompt_bytes)
    meter.sending(counted)
    return meter


def test_a_stream_cut_before_its_usage_is_charged_an_estimate_and_loses_nothing() -> None:
    cut = CHAT_USAGE[:CHAT_USAGE.index(b'"finish_reason":"length"') + 60]
    meter = sent(prompt_bytes=400)
    assert b"".join(relay(meter, [cut], strip=True)) == cut
    assert meter.reported is None
    assert meter.tokens() == 100 + cut.count(b"data:")


def test_a_json_answer_is_charged_its_reported_usage() -> None:
    meter = sent(prompt_bytes=4000)
    meter.read_body(b'{"id":"x","choices":[{"text":"usage"}],"usage":{"prompt_tokens":31,'
                    b'"total_tokens":34,"completion_tokens":3,"prompt_tokens_details":null}}')
    assert meter.tokens() == 34


def test_a_request_the_engine_never_had_or_refused_costs_nothing() -> None:
    """Refused at the gate's budget fit (never sent), or by the worker (its error answer)."""
    assert Meter(True, prompt_bytes=400).tokens() == 0
    meter = sent(prompt_bytes=400, counted=90)
    meter.refused()
    assert meter.tokens() == 0


@pytest.mark.parametrize(("counted", "charged"), [(None, 1000), (730, 730)])
def test_a_non_streamed_request_left_before_its_answer_is_charged_its_prompt(
        counted: int | None, charged: int) -> None:
    """vLLM reports nothing for an aborted request: the prompt is what is known, counted by
    the gate where it counted it, else estimated from the body's bytes."""
    meter = sent(prompt_bytes=4000, counted=counted)  # the client left: no body is read
    assert meter.tokens() == charged


def left_after(meter: Meter, chunks: list[bytes]) -> None:
    """The client reads `chunks`, then leaves while the engine is still generating."""
    async def leave() -> None:
        drained = asyncio.Event()

        async def source() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk
            drained.set()
            await asyncio.Event().wait()

        async def read() -> None:
            async for _ in meter.tap(source(), strip=False):
                pass

        reading = asyncio.ensure_future(read())
        await drained.wait()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(leave())


def test_a_stream_left_before_its_first_event_is_charged_its_prompt() -> None:
    meter = sent(prompt_bytes=4000)
    left_after(meter, [])
    assert meter.tokens() == 1000


def test_a_stream_left_mid_way_is_charged_its_reported_prompt_and_the_tokens_seen() -> None:
    """Anthropic's message_start reports the prompt exactly; the deltas seen are generated."""
    start, delta = (event + b"\n\n" for event in ANTHROPIC_STREAM.split(b"\n\n")[:2])
    meter = sent(prompt_bytes=4000)
    left_after(meter, [start, delta, delta])
    assert meter.tokens() == 12 + 3  # three events seen: message_start's and two deltas


@pytest.mark.parametrize("body", [b"not json", b'{"usage": null}', b'{"choices": []}'])
def test_a_whole_answer_without_usage_is_charged_the_estimate(body: bytes) -> None:
    meter = sent(prompt_bytes=40)
    meter.read_body(body)
    assert meter.reported is None and meter.tokens() == 10


# As vLLM 0.32 writes them (pydantic's model_dump_json, exclude_unset on Anthropic's events).
ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-1",'
    b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":0}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
    b'"stop_sequence":null},"usage":{"input_tokens":12,"output_tokens":5}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"resp_1","status":"in_progress","usage":null}}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":1,"delta":"Hi"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
    b'"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":9,'
    b'"input_tokens_details":{"cached_tokens":0},"output_tokens":4,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":13}}}\n\n')


@pytest.mark.parametrize(("stream", "tokens"), [(ANTHROPIC_STREAM, 17), (RESPONSES_STREAM, 13)])
def test_anthropic_and_responses_streams_are_charged_their_usage_and_pass_unchanged(
        stream: bytes, tokens: int) -> None:
    """Anthropic reports running totals (message_start, then message_delta): not added twice."""
    meter = sent(prompt_bytes=4000)
    assert b"".join(relay(meter, pieces(stream, [50, 333, 500]), strip=False)) == stream
    assert meter.reported == meter.tokens() == tokens


@pytest.mark.parametrize(("body", "tokens"), [
    (b'{"id":"msg_1","type":"message","usage":{"input_tokens":7,"output_tokens":3,'
     b'"cache_read_input_tokens":5}}', 15),
    (b'{"id":"resp_1","object":"response","usage":{"input_tokens":9,"output_tokens":4,'
     b'"total_tokens":13}}', 13),
])
def test_anthropic_and_responses_answers_are_charged_their_usage(body: bytes, tokens: int) -> None:
    """Anthropic's input_tokens leave out the cached part; the prompt is counted whole, as
    vLLM's prompt_tokens counts it on chat."""
    meter = sent(prompt_bytes=4000)
    meter.read_body(body)
    assert meter.tokens() == tokens
