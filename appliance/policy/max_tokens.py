"""Fit the completion budget into what the context window leaves after the prompt."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.core.errors import BadRequest
from appliance.policy.body import check_count, truncate_prompt_tokens

CLAMP_HEADER = "X-Max-Tokens-Clamped"
# The budget fields of each API, the one the engine obeys first.
CHAT_BUDGET = ("max_completion_tokens", "max_tokens")
COMPLETION_BUDGET = ("max_tokens",)


@dataclass(frozen=True)
class Clamp:
    """A completion budget lowered to fit: which field, what was asked, what is sent on."""

    field: str
    requested: int
    applied: int
    defaulted: bool = False  # the budget was the configured default, not the client's


def given_budget(body: Mapping[str, Any], fields: Sequence[str]) -> int | None:
    """The budget the engine will obey (the first field present), checked; None if absent."""
    for field in fields:
        value = body.get(field)
        if value is not None:
            check_count(value, field)
            return int(value)
    return None


def apply_default_budget(body: MutableMapping[str, Any], fields: Sequence[str],
                         default: int | None) -> bool:
    """Put the configured default in the API's first budget field when the client gave none.

    True when it did: a later clamp of that field reports the default as the source.
    """
    if default is None or any(body.get(field) is not None for field in fields):
        return False
    body[fields[0]] = default
    return True


def clamp_max_tokens(
    body: MutableMapping[str, Any],
    *,
    fields: Sequence[str],
    prompt_tokens: int,
    max_model_len: int,
    defaulted: bool = False,
) -> Clamp | None:
    """Lower every budget field above the room left to the room, in the body; report it.

    A budget above the room is clamped, not rejected; no budget leaves vLLM its own (the
    room). A prompt that leaves no room is a 400 (context_length_exceeded).
    """
    used = effective_prompt_tokens(body, prompt_tokens, max_model_len)
    room = max_model_len - used
    if room < 1:
        raise _context_exceeded(body, max_model_len, used)
    given = [field for field in fields if body.get(field) is not None]
    clamps = [clamp for field in given if (clamp := _clamp_field(body, field, room, defaulted))]
    # The first is the one vLLM obeys: max_completion_tokens wins over max_tokens.
    return clamps[0] if clamps else None


def effective_prompt_tokens(body: Mapping[str, Any], prompt_tokens: int, max_model_len: int) -> int:
    """The prompt length the engine will see once truncate_prompt_tokens has applied."""
    limit = truncate_prompt_tokens(body)
    if limit is None:
        return prompt_tokens
    if limit == -1:
        limit = max_model_len
    elif limit > max_model_len:
        raise BadRequest(
            f"'truncate_prompt_tokens' ({limit}) is greater than the model's maximum context "
            f"length ({max_model_len}).",
            param="truncate_prompt_tokens",
            code="invalid_value",
        )
    return min(prompt_tokens, limit)


def header_value(clamp: Clamp) -> str:
    """The clamp as a response header value: `requested=1000000; applied=1843`."""
    value = f"requested={clamp.requested}; applied={clamp.applied}"
    return f"{value}; source=default" if clamp.defaulted else value


def _clamp_field(body: MutableMapping[str, Any], field: str, room: int,
                 defaulted: bool) -> Clamp | None:
    requested = body[field]
    check_count(requested, field)
    if requested <= room:
        return None
    body[field] = room
    return Clamp(field=field, requested=requested, applied=room, defaulted=defaulted)


def _context_exceeded(
    body: Mapping[str, Any], max_model_len: int, prompt_tokens: int
) -> BadRequest:
    what = next((key for key in ("messages", "input") if key in body), "prompt")
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"{what} resulted in {prompt_tokens} tokens. Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
    )
