"""How an Anthropic Messages stream goes on after an engine fault.

The record keeps the text the client received and the stream's state (that `message_start`
went, the open text block's index); the continuation (appliance/recovery/text.py) is written as
that block's `content_block_delta` text deltas, then the stream's end as vLLM writes it:
`content_block_stop`, `message_delta` with the stop reason and the whole answer's usage, and
`message_stop`. The message keeps its id: it was in `message_start`, which the client has.

Resumable: a plain text answer. Not one whose worker keeps state beside its text (tools,
thinking or a reasoning parser's blocks, a structured output format, stop sequences, media):
those are replayed while the client has received nothing, and otherwise end with the
engine_lost error as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from appliance.answers.shape import sse_event
from appliance.fences.vllm import MESSAGES_RENDER
from appliance.recovery.stream import asks_any
from appliance.recovery.text import TextRecord

# Fields whose presence (with a value that asks for something) keeps a stream from resuming.
_STATEFUL = frozenset(("tools", "stop_sequences", "return_mm_kwargs", "kv_transfer_params",
                       "ec_transfer_params"))


def plain_message(body: Mapping[str, Any]) -> bool:
    """Whether a streamed body's answer is plain text, continued from its text alone."""
    if body.get("stream") is not True:
        return False
    if asks_any(body, _STATEFUL):
        return False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") != "disabled":
        return False
    config = body.get("output_config")
    return not (isinstance(config, dict) and config.get("format") is not None)


class MessagesRecord(TextRecord):
    """An Anthropic stream of one text block."""

    render_path = MESSAGES_RENDER
    delta_prefix = b"event: content_block_delta\n"
    text_key = b'"text_delta","text":"'
    text_end = b'"},"index":'

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        self._started = False  # message_start went to the client
        self._block: int | None = None  # the text block's index, once started

    @property
    def opened(self) -> bool:
        return self._started

    def read(self, name: str, data: bytes) -> None:
        if name == "message_start":
            self._started = True
        elif name == "content_block_start":
            started = msgspec.json.decode(data)
            self.plain &= started["content_block"].get("type") == "text" and self._block is None
            self._block = started["index"]
        elif name in ("content_block_stop", "message_delta"):
            self.closing = True
        elif name == "message_stop":
            self.finished = True
        else:
            self.plain = False  # thinking, a tool call, the worker's own error

    def delta(self, text: str) -> bytes:
        out = b""
        if self._block is None:  # the worker was lost before the block's first text
            self._block = 0
            out = sse_event("content_block_start", {
                "type": "content_block_start", "content_block": {"type": "text", "text": ""},
                "index": self._block})
        return out + sse_event("content_block_delta", {
            "type": "content_block_delta", "delta": {"type": "text_delta", "text": text},
            "index": self._block})

    def end(self, finish_reason: str) -> bytes:
        out = b""
        if self._block is not None:
            out = sse_event("content_block_stop", {"type": "content_block_stop",
                                                   "index": self._block})
        reason = "max_tokens" if finish_reason == "length" else "end_turn"
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        return out + sse_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": usage}) + sse_event("message_stop", {"type": "message_stop"})
