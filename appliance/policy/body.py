"""Parse a request body and check the shape of the fields the appliance knows about."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import msgspec

from appliance.core.errors import BadRequest

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# OpenAI lets these roles carry "content": null (an assistant turn made only of tool calls).
NULLABLE_CONTENT_ROLES = frozenset({"assistant", "function"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
_UNREADABLE = object()
_MAX_DEPTH = 64
_TOP = re.compile(r"^[^.\[]+")
_AT_BYTE = re.compile(r"\(byte (\d+)\)")
MAX_COUNT = 2**63 - 1  # what the engine can hold; a larger count is a typo, not a request

Check = Callable[[Any, str], None]


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BadRequest (code invalid_json) saying what is wrong.

    Strict JSON: NaN, Infinity, numbers beyond a double (1e999), invalid UTF-8 and lone
    surrogates are refused here, so nothing downstream meets a value it cannot encode.
    """
    if not raw.strip():
        raise _invalid_json("The request body is empty; expected a JSON object.")
    try:
        value = msgspec.json.decode(raw)
    except RecursionError as exc:
        raise _invalid_json("The request body is nested too deeply to parse.") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _diagnose(raw, exc) from exc
    if not isinstance(value, dict):
        raise _invalid_json(f"The request body must be a JSON object, not {_kind(value)}.")
    return value


def validate_chat(body: Mapping[str, Any]) -> None:
    """Shape checks for POST /v1/chat/completions; unknown fields are left alone."""
    _check_common(body)
    _check_messages(body)
    _optional(body, _CHAT_FIELDS)


def validate_completion(body: Mapping[str, Any]) -> None:
    """Shape checks for POST /v1/completions; unknown fields are left alone."""
    _check_common(body)
    _check_prompt(body)
    _optional(body, _COMPLETION_FIELDS)


def check_count(value: Any, param: str) -> None:
    """An integer >= 1 (n, best_of, max_tokens, ...); a JSON true is not an integer."""
    if not _is_int(value):
        _bad(f"'{param}' must be an integer, got {_show(value)}.", param, "invalid_type")
    if value < 1:
        _bad(f"'{param}' must be at least 1, got {value}.", param, "invalid_value")
    if value > MAX_COUNT:
        _bad(f"'{param}' must be at most {MAX_COUNT}.", param, "invalid_value")


def truncate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """The checked truncate_prompt_tokens: None, -1 (the whole window) or an integer >= 1."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    param = "truncate_prompt_tokens"
    if not _is_int(value):
        _bad(f"'{param}' must be an integer, got {_show(value)}.", param, "invalid_type")
    if value < 1 and value != -1:
        _bad(f"'{param}' must be -1 or at least 1, got {value}.", param, "invalid_value")
    return int(value)


def _check_common(body: Mapping[str, Any]) -> None:
    _optional(body, _COMMON_FIELDS)
    truncate_prompt_tokens(body)


def _check_messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        _bad("'messages' must be a non-empty array of message objects.", "messages", "invalid_type")
    for index, message in enumerate(messages):
        _check_message(message, f"messages[{index}]")


def _check_message(message: Any, param: str) -> None:
    if not isinstance(message, dict):
        _bad(f"'{param}' must be an object, got {_show(message)}.", param, "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        allowed = ", ".join(sorted(CHAT_ROLES))
        _bad(
            f"'{param}.role' must be one of {allowed}; got {_show(role)}.",
            f"{param}.role",
            "invalid_value",
        )
    content = message.get("content")
    if content is None:
        if role not in NULLABLE_CONTENT_ROLES:
            _bad(
                f"'{param}.content' is required for role '{role}'.",
                f"{param}.content",
                "invalid_type",
            )
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _bad(
            f"'{param}.content' must be a string or an array of content parts, got "
            f"{_show(content)}.",
            f"{param}.content",
            "invalid_type",
        )
    for index, part in enumerate(content):
        _check_part(part, f"{param}.content[{index}]")


def _check_part(part: Any, param: str) -> None:
    # vLLM takes a bare string as a text part; anything else needs a string "type".
    if isinstance(part, str):
        return
    if not isinstance(part, dict):
        _bad(f"'{param}' must be a content part object, got {_show(part)}.", param, "invalid_type")
    if not isinstance(part.get("type"), str):
        _bad(
            f"'{param}.type' must be a string naming the part type.",
            f"{param}.type",
            "invalid_type",
        )


def _check_prompt(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        if body.get("prompt_embeds") is not None:
            return
        _bad("'prompt' is required.", "prompt", "invalid_type")
    if isinstance(prompt, str) or _is_prompt_list(prompt):
        return
    _bad(
        "'prompt' must be a string, an array of strings, an array of token ids, or an array "
        "of arrays of token ids.",
        "prompt",
        "invalid_type",
    )


def _is_prompt_list(prompt: Any) -> bool:
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(item, str) for item in prompt):
        return True
    if all(_is_token(item) for item in prompt):
        return True
    return all(
        isinstance(item, list) and item and all(_is_token(token) for token in item)
        for item in prompt
    )


def _check_tools(value: Any, param: str) -> None:
    if not isinstance(value, list):
        _bad(f"'{param}' must be an array of tool objects.", param, "invalid_type")
    for index, tool in enumerate(value):
        if not isinstance(tool, dict):
            _bad(f"'{param}[{index}]' must be a tool object.", f"{param}[{index}]", "invalid_type")


def _check_tool_choice(value: Any, param: str) -> None:
    if isinstance(value, dict) or (isinstance(value, str) and value in TOOL_CHOICES):
        return
    _bad(
        f"'{param}' must be 'none', 'auto', 'required' or a named tool object; got {_show(value)}.",
        param,
        "invalid_value",
    )


def _check_logprob_count(value: Any, param: str) -> None:
    # -1 asks vLLM for the whole vocabulary; 0 is a valid count here.
    if not _is_int(value):
        _bad(f"'{param}' must be an integer, got {_show(value)}.", param, "invalid_type")
    if value < 0 and value != -1:
        _bad(f"'{param}' must be -1 or at least 0, got {value}.", param, "invalid_value")


def _check_temperature(value: Any, param: str) -> None:
    # The engine's range, not OpenAI's 0..2: the appliance is not stricter than vLLM.
    number = _number(value, param)
    if number < 0:
        _bad(f"'{param}' must be at least 0, got {value}.", param, "invalid_value")


def _check_top_p(value: Any, param: str) -> None:
    number = _number(value, param)
    if not 0 < number <= 1:
        _bad(f"'{param}' must be in (0, 1], got {value}.", param, "invalid_value")


def _check_bool(value: Any, param: str) -> None:
    if not isinstance(value, bool):
        _bad(f"'{param}' must be a boolean, got {_show(value)}.", param, "invalid_type")


def _check_str(value: Any, param: str) -> None:
    if not isinstance(value, str):
        _bad(f"'{param}' must be a string, got {_show(value)}.", param, "invalid_type")


def _check_object(value: Any, param: str) -> None:
    if not isinstance(value, dict):
        _bad(f"'{param}' must be an object, got {_show(value)}.", param, "invalid_type")


def _optional(body: Mapping[str, Any], checks: tuple[tuple[str, Check], ...]) -> None:
    """Check each field, in order, where present; JSON null counts as absent, as it does for
    OpenAI (one call for them all: every generation request comes here)."""
    for key, check in checks:
        value = body.get(key)
        if value is not None:
            check(value, key)


def _number(value: Any, param: str) -> float:
    # An int JSON allows (any length) can be past every float: float() and isfinite() overflow.
    number = float(value) if isinstance(value, float) or (
        _is_int(value) and abs(value) <= sys.float_info.max) else math.nan
    if not math.isfinite(number):
        _bad(f"'{param}' must be a number, got {_show(value)}.", param, "invalid_type")
    return number


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _diagnose(raw: bytes, exc: msgspec.MsgspecError) -> BadRequest:
    """What is wrong with a body msgspec refused, naming the field where there is one.

    Only on this error path the body is read again, leniently (Python's json accepts lone
    surrogates and 1e999), to find the first value the engine could not take and its path.
    """
    try:
        lenient = json.loads(raw)
    except (ValueError, RecursionError):
        lenient = _UNREADABLE
    found = _first_bad_value(lenient, "") if lenient is not _UNREADABLE else None
    if found is None:
        if isinstance(exc, msgspec.ValidationError):
            return _invalid_json(f"The request body holds a number JSON cannot carry: {exc}.")
        return _invalid_json(f"The request body is not valid JSON: {_describe(raw, exc)}.")
    path, what = found
    top = _TOP.match(path)
    return BadRequest(f"The request body is not valid JSON: '{path}' {what}.",
                      param=top.group(0) if top else path, code="invalid_json")


def _first_bad_value(value: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """(path, why) of the first string with a lone surrogate or non-finite number."""
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return path or "$", "is not a finite number (NaN, Infinity or beyond a double)"
    if isinstance(value, str):
        return (path or "$", "holds a lone surrogate escape") if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if _has_surrogate(key):
                return path or "$", "has a key with a lone surrogate escape"
            if (found := _first_bad_value(item, where, depth + 1)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _first_bad_value(item, f"{path}[{index}]", depth + 1)) is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _describe(raw: bytes, exc: msgspec.MsgspecError) -> str:
    """msgspec's reason with its byte offset turned into a line and column a person can find."""
    text = str(exc).removeprefix("JSON is malformed: ")
    match = _AT_BYTE.search(text)
    if match is None:
        if text == "Input data was truncated":
            return "it ends early, or holds a lone surrogate escape (\\ud800-\\udfff)"
        return text[0].lower() + text[1:] if text else "malformed"
    offset = int(match.group(1))
    line = raw.count(b"\n", 0, offset) + 1
    column = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
    return f"{text[:match.start()].rstrip()} at line {line} column {column}"


def _invalid_json(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_json")


def _bad(message: str, param: str, code: str) -> NoReturn:
    raise BadRequest(message, param=param, code=code)


def _kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _show(value: Any) -> str:
    """A short rendering of a client value for a message; never the whole payload."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The optional fields each route checks, in the order their errors are reported.
_COMMON_FIELDS: tuple[tuple[str, Check], ...] = (
    ("model", _check_str), ("stream", _check_bool), ("n", check_count), ("best_of", check_count),
    ("max_tokens", check_count), ("temperature", _check_temperature), ("top_p", _check_top_p))
_CHAT_FIELDS: tuple[tuple[str, Check], ...] = (
    ("max_completion_tokens", check_count), ("logprobs", _check_bool),
    ("top_logprobs", _check_logprob_count), ("tools", _check_tools),
    ("tool_choice", _check_tool_choice), ("chat_template_kwargs", _check_object))
_COMPLETION_FIELDS: tuple[tuple[str, Check], ...] = (
    ("logprobs", _check_logprob_count), ("echo", _check_bool))
