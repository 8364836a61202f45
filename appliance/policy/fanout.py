"""Bounds on how much work one body holds: messages per conversation, prompts per request, and
the sequences it makes the engine run at once (what admission counts it as)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.admission.clients import Client
from appliance.core.errors import BadRequest


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


def batch_size(items: Any) -> int:
    """The prompts a `prompt` field holds: a list of texts or of token lists is a batch; a text
    or one token list is one prompt."""
    if isinstance(items, list) and items and not isinstance(items[0], int):
        return len(items)
    return 1


def sequences(prompts: int, body: Mapping[str, Any]) -> int:
    """The sequences the engine runs at once for `prompts` prompts: `n` of each (the gate's
    field check has made `n` an integer, and check_n bounded it)."""
    n = body.get("n")
    return prompts * (n if isinstance(n, int) and n > 1 else 1)


def check_sequences(count: int, param: str, max_inflight: int, client: Client) -> None:
    """A fan-out that alone exceeds an in-flight limit would wait for ever: refused at once,
    naming the limit (the global policy.max_inflight or the client's own max_inflight)."""
    if count > max_inflight:
        limit = f"policy.max_inflight, {max_inflight}"
    elif client.max_inflight is not None and count > client.max_inflight:
        limit = f"client '{client.name}' max_inflight, {client.max_inflight}"
    else:
        return
    raise BadRequest(f"the request makes the engine run {count} sequences at once (prompts x "
                     f"'n'), more than the limit ({limit}) on what one client may hold; split "
                     "it into smaller requests.", param=param, code="too_many_sequences")
