"""How a Responses stream goes on after an engine fault.

The record keeps the text the client received and the stream's state (its response object from
`response.created`, the message item's id and indices, the last sequence number); the
continuation (appliance/recovery/text.py) is written as the same item's
`response.output_text.delta` events, numbered on from the last one, then its end as vLLM writes
it: `output_text.done`, `content_part.done`, `output_item.done` with the whole text, and
`response.completed` with the status and usage of the whole answer.

Resumable: a plain text answer. Not one whose worker keeps state beside its text (tools, a
reasoning parser's items, a structured `text.format` or structured outputs, logprobs, stop
strings, media, input and output messages echoed back), nor a background response or one that
continues a `previous_response_id` (the stateless render refuses it). Those are replayed while
the client has received nothing, and otherwise end with the engine_lost error as before.

A stored response lives in the worker's memory: the continuation is not stored, so retrieving
a resumed response's id answers 404 response_lost_in_restart, as for any response a restart
lost (appliance/apis/responses/response_ids.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from appliance.answers.shape import sse_event
from appliance.fences.vllm import RESPONSES_RENDER
from appliance.recovery.stream import asks_any
from appliance.recovery.text import TextRecord

_SEQUENCE = re.compile(rb'"sequence_number":(\d+)')
# Fields whose presence (with a value that asks for something) keeps a stream from resuming.
_STATEFUL = frozenset((
    "tools", "previous_response_id", "background", "top_logprobs", "structured_outputs", "stop",
    "enable_response_messages", "previous_input_messages", "return_mm_kwargs",
    "kv_transfer_params", "ec_transfer_params",
))
_TEXT_PART = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}


def plain_response(body: Mapping[str, Any]) -> bool:
    """Whether a streamed body's answer is plain text, continued from its text alone."""
    if body.get("stream") is not True:
        return False
    if asks_any(body, _STATEFUL):
        return False
    include = body.get("include")
    if isinstance(include, list) and any("logprobs" in str(item) for item in include):
        return False
    text = body.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    return not (isinstance(form, dict) and form.get("type") not in (None, "text"))


class ResponsesRecord(TextRecord):
    """A Responses stream of one message item."""

    render_path = RESPONSES_RENDER
    delta_prefix = b"event: response.output_text.delta\n"
    text_key = b'"delta":"'
    text_end = b'","item_id":"'

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        self._response: dict[str, Any] | None = None  # as response.created gave it
        self._item: str | None = None  # the message item's id, once added
        self._output_index = 0
        self._content_index = 0
        self._sequence = -1  # the last event's number

    @property
    def opened(self) -> bool:
        return self._response is not None

    def read(self, name: str, data: bytes) -> None:
        if name == "response.created":
            self._response = msgspec.json.decode(data)["response"]
        elif name == "response.output_item.added":
            added = msgspec.json.decode(data)
            self.plain &= added["item"].get("type") == "message" and self._item is None
            self._item, self._output_index = added["item"]["id"], added["output_index"]
        elif name == "response.content_part.added":
            added = msgspec.json.decode(data)
            self.plain &= added["part"].get("type") == "output_text"
            self._content_index = added["content_index"]
        elif name in ("response.output_text.done", "response.content_part.done",
                      "response.output_item.done"):
            self.closing = True
        elif name in ("response.completed", "response.incomplete", "response.failed"):
            self.finished = True
        elif name != "response.in_progress":
            self.plain = False  # reasoning, a tool call, a refusal: the worker's state

    def seam(self, last: bytes) -> None:
        found = _SEQUENCE.findall(last)
        if found:
            self._sequence = int(found[-1])

    def _next(self, name: str, data: dict[str, Any]) -> bytes:
        """The event numbered next; its number and type go last unless `data` places them."""
        self._sequence += 1
        data["sequence_number"], data["type"] = self._sequence, name
        return sse_event(name, data)

    def delta(self, text: str) -> bytes:
        out = b"" if self._item is not None else self._open()
        return out + self._next("response.output_text.delta", {
            "content_index": self._content_index, "delta": text, "item_id": self._item,
            "logprobs": [], "output_index": self._output_index})

    def _open(self) -> bytes:
        """The message item, where the worker was lost before its first text."""
        self._item = f"msg_{uuid.uuid4().hex[:16]}"
        item: dict[str, Any] = {"id": self._item, "content": [], "role": "assistant",
                                "status": "in_progress", "type": "message", "phase": None}
        return self._next("response.output_item.added",
                          {"item": item, "output_index": self._output_index}) + \
            self._next("response.content_part.added", {
                "content_index": self._content_index, "item_id": self._item,
                "output_index": self._output_index, "part": _TEXT_PART})

    def end(self, finish_reason: str) -> bytes:
        output: list[dict[str, Any]] = []
        out = b""
        if self._item is not None:
            out, item = self._close()
            output.append(item)
        assert self._response is not None
        incomplete = finish_reason == "length"
        response = self._response | {
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "status": "incomplete" if incomplete else "completed",
            "usage": self._usage()}
        return out + self._next("response.completed", {"response": response})

    def _close(self) -> tuple[bytes, dict[str, Any]]:
        """The message item's end events, and the item."""
        text = self.text
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text",
                                "logprobs": None}
        where = {"content_index": self._content_index, "item_id": self._item,
                 "output_index": self._output_index}
        item = {"id": self._item, "content": [part] if text else [], "role": "assistant",
                "status": "completed", "type": "message", "phase": None}
        out = self._next("response.output_text.done", {
            "content_index": self._content_index, "item_id": self._item, "logprobs": [],
            "output_index": self._output_index, "sequence_number": None, "text": text,
            "type": None})
        out += self._next("response.content_part.done", where | {"part": part})
        out += self._next("response.output_item.done",
                          {"item": item, "output_index": self._output_index})
        return out, item

    def _usage(self) -> dict[str, Any]:
        prompt, output = self.input_tokens, self.output_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output}
