"""Shape checks for the bodies of the routes beyond chat and completions: Responses, Anthropic
Messages, the chat batch and the tokenizer. Field types are fields.py's; these check what a
type cannot say (a required field, a count, the parts of a conversation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from appliance.core.errors import BadRequest
from appliance.policy.body import check_count, validate_chat

ANTHROPIC_ROLES = frozenset({"user", "assistant", "system"})


def validate_responses(body: Mapping[str, Any]) -> None:
    """POST /v1/responses: an input, a budget that is a count."""
    if body.get("input") is None:
        _bad("'input' is required: a string or an array of input items.", "input",
             "missing_required_field")
    _count(body, "max_output_tokens")
    _count(body, "max_tool_calls")


def validate_messages(body: Mapping[str, Any]) -> None:
    """POST /v1/messages: Anthropic requires max_tokens, and so does the appliance."""
    validate_count_tokens(body)
    if body.get("max_tokens") is None:
        _bad("'max_tokens' is required: the most tokens to generate.", "max_tokens",
             "missing_required_field")
    _count(body, "max_tokens")


def validate_count_tokens(body: Mapping[str, Any]) -> None:
    """POST /v1/messages/count_tokens: a non-empty conversation of Anthropic messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        _bad("'messages' must be a non-empty array of message objects.", "messages",
             "invalid_type")
    for index, message in enumerate(messages):
        _anthropic_message(message, f"messages[{index}]")


def validate_batch_chat(body: Mapping[str, Any]) -> None:
    """POST /v1/chat/completions/batch: each conversation is checked as a chat's messages."""
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        _bad("'messages' must be a non-empty array of conversations (arrays of messages).",
             "messages", "invalid_type")
    rest = {key: value for key, value in body.items() if key != "messages"}
    for index, conversation in enumerate(conversations):
        try:
            validate_chat(rest | {"messages": conversation})
        except BadRequest as exc:
            param = exc.param or "messages"
            if param.startswith("messages"):
                param = f"messages[{index}]{param.removeprefix('messages')}"
            raise BadRequest(exc.message.replace("'messages", f"'messages[{index}]", 1),
                             param=param, code=exc.code) from exc


def validate_tokenize(body: Mapping[str, Any]) -> None:
    """POST /tokenize: a prompt, or chat messages (checked as a chat's)."""
    if body.get("messages") is not None:
        validate_chat(body)
    elif not isinstance(body.get("prompt"), str):
        _bad("'prompt' (a string) or 'messages' (an array of messages) is required.", "prompt",
             "missing_required_field")


def validate_detokenize(body: Mapping[str, Any]) -> None:
    """POST /detokenize: token ids."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(not isinstance(t, int) or isinstance(t, bool)
                                           or t < 0 for t in tokens):
        _bad("'tokens' must be an array of token ids (integers >= 0).", "tokens", "invalid_type")


def _anthropic_message(message: Any, param: str) -> None:
    if not isinstance(message, dict):
        _bad(f"'{param}' must be a message object.", param, "invalid_type")
    if message.get("role") not in ANTHROPIC_ROLES:
        _bad(f"'{param}.role' must be one of assistant, system, user.", f"{param}.role",
             "invalid_value")
    content = message.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _bad(f"'{param}.content' must be a string or an array of content blocks.",
             f"{param}.content", "invalid_type")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            where = f"{param}.content[{index}]"
            _bad(f"'{where}' must be a content block with a string 'type'.", where,
                 "invalid_type")


def _count(body: Mapping[str, Any], key: str) -> None:
    if body.get(key) is not None:
        check_count(body[key], key)


def _bad(message: str, param: str, code: str) -> NoReturn:
    raise BadRequest(message, param=param, code=code)
