"""Bounds on how much work one body holds: messages per conversation, prompts per request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.errors import BadRequest


def check_message_count(raw: bytes, max_messages: int) -> None:
    """Refuse an absurd number of messages before parsing them (parsing costs the loop).

    Every message has a "role" key, and inside a JSON string a quote is escaped, so counting
    `"role"` in the raw bytes bounds the message count from above, at memchr speed. The exact
    count is checked again once parsed."""
    if raw.count(b'"role"') > max_messages:
        raise BadRequest(f"'messages' holds more than {max_messages} messages (setting "
                         "policy.max_messages).", param="messages", code="too_many_messages")


def check_conversation(body: Mapping[str, Any], max_messages: int) -> None:
    """A conversation is bounded too: each message is template work and prompt tokens."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise BadRequest(f"'messages' holds {len(messages)} messages; at most {max_messages} "
                         "are accepted (setting policy.max_messages).", param="messages",
                         code="too_many_messages")


def check_prompts(body: Mapping[str, Any], max_prompts: int) -> None:
    """A batch of prompts is bounded: each one is a sequence for the engine to prefill."""
    prompts = body.get("prompt")
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        _check_fanout(prompts, "prompt", "prompts", max_prompts)


def check_conversations(body: Mapping[str, Any], max_prompts: int) -> None:
    """A batch of conversations is bounded as a batch of prompts is."""
    conversations = body.get("messages")
    if isinstance(conversations, list):
        _check_fanout(conversations, "messages", "conversations", max_prompts)


def _check_fanout(items: list[Any], key: str, what: str, max_prompts: int) -> None:
    if len(items) > max_prompts:
        raise BadRequest(f"'{key}' holds {len(items)} {what}; at most {max_prompts} are "
                         "accepted per request (setting policy.max_batch_prompts).",
                         param=key, code="too_many_prompts")
