"""What a client saw of one request under faults: its failure, if any, and the seams in its text.

Each protocol's answer (chat and completions, OpenAI's SSE or JSON; Responses and Anthropic
Messages, named SSE events or JSON) is read into the same facts: the text, the ids it named,
its role announcements, its error events, whether it ended as the protocol ends a complete
answer. A failure is what a client would see as one (an HTTP error, a broken connection, a
stream that stops short or ends on an error event); a seam is what a resumed stream could get
wrong while still succeeding (a second role chunk, a second id, text that differs from an
uninterrupted greedy run's of the same prompt).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Event = tuple[str | None, str]  # an SSE event's name (None: unnamed) and its data


@dataclass
class Facts:
    """One answer as every protocol can be read: text, ids, roles, errors, a proper end."""

    text: str = ""
    ids: list[str] = field(default_factory=list)  # in order, each once
    roles: int = 0  # role announcements: one per answer
    errors: list[str] = field(default_factory=list)  # error events' codes (or messages)
    complete: bool = False  # ended as the protocol ends a finished answer

    def named(self, value: object) -> None:
        if isinstance(value, str) and value and value not in self.ids:
            self.ids.append(value)

    def error(self, error: object) -> None:
        if isinstance(error, dict):
            self.errors.append(str(error.get("code") or error.get("type") or error.get("message")))
        else:
            self.errors.append(str(error))


@dataclass
class Result:
    """One request as the client lived it."""

    route: str  # the scenario's route name (chat, chat-stream, ...)
    prompt: str
    started: float  # seconds since the run began
    ended: float
    status: int | None = None  # None: no HTTP answer at all
    transport: str | None = None  # the connection failed: its exception's name
    facts: Facts | None = None
    ttft_s: float | None = None  # the first text's arrival, for streams
    retries: int = 0  # 503s asked again after their Retry-After, as an SDK does
    retry_after_s: float | None = None  # the last 503's Retry-After, if it was one

    @property
    def total_s(self) -> float:
        return self.ended - self.started


def openai_events(events: Iterable[Event], chat: bool) -> Facts:
    facts = Facts()
    for _, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            facts.error(chunk["error"])
            continue
        facts.named(chunk.get("id"))
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {}) if chat else choice
            facts.roles += 1 if chat and delta.get("role") else 0
            facts.text += (delta.get("content") if chat else delta.get("text")) or ""
            facts.complete = facts.complete or choice.get("finish_reason") is not None
    facts.complete = facts.complete and not facts.errors
    return facts


@dataclass(frozen=True)
class _Vocabulary:
    """How one protocol's named events tell an answer's facts."""

    start: str  # the event that opens the answer and names it
    opened: Callable[[dict[str, Any]], Any]  # its id, from that event
    delta: str
    text: Callable[[dict[str, Any]], Any]  # the text a delta adds
    done: str  # the event of a finished answer
    errors: dict[str, Callable[[dict[str, Any]], Any]]  # error events, each its error


_RESPONSES = _Vocabulary(
    "response.created", lambda e: e["response"].get("id"), "response.output_text.delta",
    lambda e: e.get("delta"), "response.completed",
    {"error": lambda e: e, "response.failed": lambda e: e["response"].get("error")})
_ANTHROPIC = _Vocabulary(
    "message_start", lambda e: e["message"].get("id"), "content_block_delta",
    lambda e: e.get("delta", {}).get("text"), "message_stop", {"error": lambda e: e.get("error")})


def _named_events(events: Iterable[Event], words: _Vocabulary) -> Facts:
    facts = Facts()
    for name, data in events:
        event = json.loads(data)
        if name == words.start:
            facts.named(words.opened(event))
            facts.roles += 1
        elif name == words.delta:
            facts.text += words.text(event) or ""
        elif name == words.done:
            facts.complete = True
        elif name in words.errors:
            facts.error(words.errors[name](event))
    facts.complete = facts.complete and not facts.errors
    return facts


def responses_events(events: Iterable[Event]) -> Facts:
    return _named_events(events, _RESPONSES)


def anthropic_events(events: Iterable[Event]) -> Facts:
    return _named_events(events, _ANTHROPIC)


def json_answer(body: dict[str, Any], protocol: str) -> Facts:
    """A whole (non-streamed) answer of `protocol`: chat, completions, responses, messages."""
    facts = Facts(complete=True, roles=1)
    facts.named(body.get("id"))
    if protocol == "chat":
        facts.text = body["choices"][0]["message"].get("content") or ""
    elif protocol == "completions":
        facts.text = body["choices"][0].get("text") or ""
    elif protocol == "responses":
        facts.text = "".join(part.get("text") or "" for item in body.get("output", [])
                             for part in item.get("content") or [])
    else:
        facts.text = "".join(block.get("text") or "" for block in body.get("content", []))
    return facts


def failure(result: Result) -> str | None:
    """What the client saw go wrong, as one class; None for a complete answer."""
    if result.transport is not None:
        return f"connection: {result.transport}"
    if result.status is None:
        return "no answer"
    if result.status >= 400:
        return "503" if result.status == 503 else f"http {result.status}"
    facts = result.facts
    if facts is None:
        return "unreadable answer"
    if facts.errors:
        return f"error event: {facts.errors[0]}"
    if not facts.complete:
        return "broken stream"
    return None


def seams(result: Result, reference: str | None) -> list[str]:
    """What a successful answer shows of an interruption; [] for a failed one."""
    facts = result.facts
    if facts is None or failure(result) is not None:
        return []
    found = []
    if facts.roles > 1:
        found.append("duplicated role")
    if len(facts.ids) > 1:
        found.append("second id")
    if reference is not None and facts.text != reference:
        found.append("text discontinuity")
    return found
