"""What a stream without token ids keeps and how it is continued (appliance/recovery/text.py),
through the Responses record on events as vLLM 0.32 writes them (captured from the worker):
the text the client has, JSON escapes and all; the continuation's request from the worker's
render and tokenization of that text."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.apis.responses.resume import ResponsesRecord
from appliance.core.errors import UpstreamError

pytestmark = pytest.mark.anyio

CAPTURED = Path(__file__).parents[1] / "apis"
PROMPT = list(range(100, 137))  # 37 ids, as the captured render's
GREEDY = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
          "temperature": 0.0, "stop": [], "stop_token_ids": [], "max_tokens": 40,
          "output_kind": 1, "skip_clone": True, "extra_args": {}, "bad_words": [],
          "skip_reading_prefix_cache": False}  # the captured render's, as vLLM wrote them


def captured(name: str) -> list[bytes]:
    """A stream the worker wrote, event by event."""
    raw = (CAPTURED / name).read_bytes()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


class Worker:
    """The new worker as a record's preparation asks it: a render, a tokenization."""

    def __init__(self, prompt: list[int], params: dict[str, Any], tokens: list[int],
                 status: int = 200) -> None:
        self.prompt, self.params, self.tokens, self.status = prompt, params, tokens, status
        self.asked: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        self.asked.append((path, payload))
        if self.status != 200:
            return self.status, b'{"error": {"message": "no", "code": 400}}'
        if path == "/tokenize":
            return 200, json.dumps({"count": len(self.tokens), "tokens": self.tokens}).encode()
        rendered = {"token_ids": self.prompt, "sampling_params": self.params}
        if path == "/v1/completions/render":  # one rendering per prompt
            return 200, json.dumps([rendered]).encode()
        return 200, json.dumps(rendered).encode()


def completion(text: str, ids: list[int], finish: str | None = None) -> bytes:
    """An event of the continuation, as vLLM's completions stream writes it."""
    event = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                          "stop_reason": None, "prompt_token_ids": None, "token_ids": ids}]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


BODY = {"model": "m", "input": "Write a story about a storm.", "max_output_tokens": 40,
        "temperature": 0, "stream": True, "request_id": "resp_capture1"}


def delta(text: str, sequence: int) -> bytes:
    data = {"content_index": 0, "delta": text, "item_id": "msg_1", "logprobs": [],
            "output_index": 0, "sequence_number": sequence, "type": "response.output_text.delta"}
    return (b"event: response.output_text.delta\ndata: "
            + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


def test_the_text_is_kept_as_sent_however_the_reads_cut_it() -> None:
    record = ResponsesRecord(BODY)
    head = b"".join(captured("vllm_responses_stream.sse")[:4])
    tricky = ['He said "no"', " \\ back", " é 😀", "\n"]
    stream = head + b"".join(delta(text, 4 + i) for i, text in enumerate(tricky))
    cuts = [0, 7, 300, 1001, 1500, len(stream) - 3, len(stream)]
    given = b"".join(record.take(stream[a:b]) for a, b in itertools.pairwise(cuts))
    assert given == stream  # the client's bytes untouched
    assert record.text == "".join(tricky)
    assert record.resumable


async def test_the_continuation_is_the_prompt_and_the_text_as_the_new_worker_renders_them(
) -> None:
    record = ResponsesRecord(BODY)
    for event in captured("vllm_responses_stream.sse")[:14]:  # ten text deltas
        record.take(event)
    worker = Worker(PROMPT, GREEDY, tokens=[7] * 10)
    await record.prepare(worker)
    continuation = record.continuation()
    assert continuation.target == "/v1/completions"
    (render, rendered), (tokenize, tokenized) = worker.asked
    assert (render, rendered) == ("/v1/responses/render", BODY)
    assert tokenize == "/tokenize" and tokenized == {
        "prompt": "As the last wisps of sunlight faded from the",
        "add_special_tokens": False, "model": "m"}
    body = json.loads(continuation.body or b"")
    assert body["prompt"] == PROMPT + [7] * 10 and body["max_tokens"] == 30
    assert body["model"] == "m" and body["stream"] is True and body["return_token_ids"] is True
    # What the render left out is SamplingParams' default, given: the completions route would
    # otherwise take the model's generation config (SmolLM2's temperature 0.2, top_p 0.9).
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.0, 1.0, 0, 0.0)
    assert "stop" not in body and "seed" not in body and "input" not in body


async def test_the_sampling_parameters_are_the_renders_and_min_tokens_counts_what_was_sent(
) -> None:
    record = ResponsesRecord(BODY)
    for event in captured("vllm_responses_stream.sse")[:6]:
        record.take(event)
    params = GREEDY | {"temperature": 0.7, "top_p": 0.9, "seed": 11, "min_tokens": 5,
                       "logit_bias": {"42": 1.5}, "max_tokens": 100}
    await record.prepare(Worker(PROMPT, params, tokens=[1, 2]))
    body = json.loads(record.continuation().body or b"")
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.7, 0.9, 11)
    assert body["min_tokens"] == 3 and body["max_tokens"] == 98
    assert body["logit_bias"] == {"42": 1.5}


async def test_nothing_sent_yet_is_nothing_to_tokenize() -> None:
    record = ResponsesRecord(BODY)
    for event in captured("vllm_responses_stream.sse")[:2]:  # created, in progress
        record.take(event)
    worker = Worker(PROMPT, GREEDY, tokens=[])
    await record.prepare(worker)
    assert [path for path, _ in worker.asked] == ["/v1/responses/render"]
    assert json.loads(record.continuation().body or b"")["prompt"] == PROMPT


async def test_a_refused_render_is_the_workers_error() -> None:
    record = ResponsesRecord(BODY)
    for event in captured("vllm_responses_stream.sse")[:6]:
        record.take(event)
    with pytest.raises(UpstreamError) as refused:
        await record.prepare(Worker(PROMPT, GREEDY, tokens=[], status=400))
    assert refused.value.status == 400
