"""How an API counts its prompt for the budget: what it may ask of the worker, and cheap bounds.

Counting a prompt exactly takes a round trip to the worker (same tokenizer, same template), so
an API first gives a cheap upper bound: a byte-level tokenizer never makes more tokens than the
UTF-8 bytes it reads, so the raw body's length plus the template's own tokens (measured once
per worker: Limits) bounds a rendered prompt. Only a request whose budget plus that bound
exceeds the window is counted exactly, through the PromptCounter the gate's BudgetFitter is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

SAFETY_TOKENS = 8
# The request keys that change how a chat prompt is rendered, as vLLM's /tokenize takes them.
TEMPLATE_KEYS = ("messages", "tools", "chat_template", "chat_template_kwargs",
                 "add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "mm_processor_kwargs", "media_io_kwargs")
# Tools and tool calls may be re-serialised by the template with indentation: allow 3x bytes.
_REFORMATTED = ("tools", "documents")


@dataclass(frozen=True)
class Limits:
    """What one worker's tokenizer and template cost: measured once per worker process."""

    window: int
    chat_base: int  # a one-message conversation with empty content
    chat_per_message: int
    prompt_base: int  # the special tokens around a raw prompt


class PromptCounter(Protocol):
    """The worker's own counts of a prompt; each None where the worker cannot say."""

    async def tokenize(self, payload: dict[str, Any]) -> int | None:
        """/tokenize (chat messages with the template, or a raw prompt) for the served model."""
        ...

    async def render(self, path: str, body: dict[str, Any]) -> int | None:
        """The length of the prompt a worker's render route makes of this very body."""
        ...

    async def count(self, path: str, payload: dict[str, Any], key: str) -> int | None:
        """A worker route that answers the count itself, under `key`."""
        ...

    def check_counted(self, count: int, param: str, what: str) -> None:
        """Refuse a batch with more long prompts than one request may have counted."""
        ...


def chat_bound(body: Mapping[str, Any], raw_len: int, limits: Limits, turns: int,
               multimodal: bool) -> float:
    """A conversation's bound, or infinity where none is cheap: images expand to many tokens,
    a custom template to anything, and a previous response's history lives in the worker."""
    if multimodal or body.get("chat_template") is not None \
            or body.get("previous_response_id") is not None:
        return math.inf
    return rendered_bound(body, raw_len, limits, turns)


def rendered_bound(body: Mapping[str, Any], raw_len: int, limits: Limits, turns: int) -> float:
    """A byte-level tokenizer makes at most one token per byte of the text the template is
    given, which the raw body holds; the template's own tokens are measured per message."""
    factor = 3 if any(body.get(key) for key in _REFORMATTED) else 1
    overhead = limits.chat_base + (limits.chat_per_message + 1) * turns
    return overhead + factor * raw_len + SAFETY_TOKENS
